"""FilterSets of the gateway app, shared by the console and the API."""

import django_filters

from berth.filters import DateTimeFilter
from gateway.batch.files import ENDPOINTS
from gateway.batch.service import ACTIVE
from gateway.models import Batch, UsageRecord
from tenancy.access import subtree


class ScopePathFilterSet(django_filters.FilterSet):
    """``scope``: the rows of a scope path and those below it, by the ``scope_path`` they keep."""

    scope = django_filters.CharFilter(method="under_scope", label="Scope path (and below)")

    def under_scope(self, queryset, name, value):
        return queryset.filter(subtree(value.rstrip("/"), "scope_path"))


class UsageRecordFilterSet(ScopePathFilterSet):
    model = django_filters.CharFilter(field_name="model_served")
    since = DateTimeFilter(field_name="started_at", lookup_expr="gte")
    until = DateTimeFilter(field_name="started_at", lookup_expr="lt")
    key = django_filters.CharFilter(field_name="key_prefix")

    class Meta:
        model = UsageRecord
        fields = ["request_id", "status", "endpoint", "model", "scope", "since", "until", "key"]


class BatchFilterSet(ScopePathFilterSet):
    """The Batch API's batches, for the console's Batches page and ``/api/gateway/batches/``."""

    status = django_filters.ChoiceFilter(choices=Batch.Status.choices)
    active = django_filters.BooleanFilter(method="still_active", label="Not ended yet")
    endpoint = django_filters.ChoiceFilter(choices=[(url, url) for url in ENDPOINTS])
    client = django_filters.UUIDFilter(field_name="client__public_id", label="Service client (id)")
    since = DateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = DateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Batch
        fields = ["status", "active", "endpoint", "scope", "client", "since", "until"]

    def still_active(self, queryset, name, value):
        return queryset.filter(status__in=ACTIVE) if value else queryset.exclude(status__in=ACTIVE)
