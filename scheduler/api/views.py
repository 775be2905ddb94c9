from django_filters.rest_framework import DjangoFilterBackend
from rest_framework import viewsets

from scheduler.api.serializers import NodeSerializer
from scheduler.filtersets import NodeFilterSet
from scheduler.models import Node


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """The fleet's nodes, looked up by their public id."""

    queryset = Node.objects.prefetch_related("engines")
    serializer_class = NodeSerializer
    lookup_field = "public_id"
    lookup_value_converter = "uuid"
    filter_backends = [DjangoFilterBackend]
    filterset_class = NodeFilterSet
