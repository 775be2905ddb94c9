"""The gateway's management API: usage records, narrowed to the caller's scopes before any filter."""

from django_filters.rest_framework import DjangoFilterBackend
from rest_framework import mixins, viewsets

from gateway import services
from gateway.api.serializers import UsageRecordSerializer
from gateway.filtersets import UsageRecordFilterSet


class UsageRecordViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Usage: one record per request through /v1/ (no content). Look one up by its request id."""

    serializer_class = UsageRecordSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = UsageRecordFilterSet
    lookup_field = "request_id"
    lookup_value_regex = "[A-Za-z0-9._:-]+"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return services.UsageRecord.objects.none()
        return services.visible_usage(self.request.user).select_related("client")

    def get_object(self):
        # Client-chosen request ids may repeat: the latest record wins; none visible is a 404.
        from django.http import Http404

        record = self.filter_queryset(self.get_queryset()).filter(
            request_id=self.kwargs["request_id"]).order_by("-started_at").first()
        if record is None:
            raise Http404
        return record
