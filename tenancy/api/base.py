"""The management API's base viewset, for every app's viewsets.

Lookups by public id, filters from the app's FilterSets, and the one place where querysets are
narrowed to what the caller may see (``narrow``), so a forgotten filter cannot happen. An object
outside that reach is a 404, never a 403 that confirms it exists. Bodies are read by ``parsed``,
which refuses a field the endpoint does not take rather than ignoring it.
"""

from __future__ import annotations

from django_filters.rest_framework import DjangoFilterBackend
from rest_framework import serializers, status, viewsets
from rest_framework.response import Response

from tenancy import access
from tenancy.audit import Actor
from tenancy.models import Scope

UUID_PATTERN = "[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"


class TenancyViewSet(viewsets.GenericViewSet):
    """Base of every management viewset: rows narrowed to the caller's tenancy before any handler."""

    lookup_field = "public_id"
    # Only a UUID routes to an object, so anything else is a 404 from the URL itself and no lookup ever
    # hands the database a value it cannot compare (the routers here match regular expressions).
    lookup_value_regex = UUID_PATTERN
    filter_backends = [DjangoFilterBackend]
    # The path from a row to its Scope, as ``access.visible_to`` takes it ("" for Scopes themselves).
    scope_field = "scope"

    def get_queryset(self):
        queryset = super().get_queryset()
        if getattr(self, "swagger_fake_view", False):  # schema generation: no caller
            return queryset.none()
        return self.narrow(queryset)

    def narrow(self, queryset):
        """The rows the caller may see; a viewset whose rows are not reached through a Scope says
        here what its rule is instead."""
        return access.visible_to(self.request.user, queryset, self.scope_field)

    @property
    def actor(self) -> Actor:
        return Actor.from_request(self.request)

    def parsed(self, serializer_class, **kwargs) -> dict:
        serializer = serializer_class(data=self.request.data, context=self.get_serializer_context(), **kwargs)
        # A field this endpoint does not take is refused, not ignored: a caller who sends ``project``
        # to an update must learn that it did not move the client.
        unknown = set(self.request.data) - set(serializer.fields) if hasattr(self.request.data, "keys") else set()
        if unknown:
            raise serializers.ValidationError({name: ["This field is not accepted here."] for name in sorted(unknown)})
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data

    def visible_scopes(self):
        return access.visible_to(self.request.user, Scope.objects.all(), "")

    def render(self, instance, serializer_class=None, status_code=status.HTTP_200_OK, **context):
        serializer_class = serializer_class or self.get_serializer_class()
        data = serializer_class(instance, context=self.get_serializer_context() | context).data
        return Response(data, status=status_code)
