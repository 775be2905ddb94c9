from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView


class ApiRootView(APIView):
    """What the management API offers, as links."""

    @extend_schema(exclude=True)
    def get(self, request):
        return Response({
            "schema": reverse("schema", request=request),
            "docs": reverse("api-docs", request=request),
            "nodes": reverse("scheduler-api:node-list", request=request),
        })
