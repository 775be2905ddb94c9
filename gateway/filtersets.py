"""FilterSets of the gateway app, shared by the console and the API."""

import django_filters

from berth.filters import DateTimeFilter
from gateway.models import UsageRecord
from tenancy.access import subtree


class UsageRecordFilterSet(django_filters.FilterSet):
    model = django_filters.CharFilter(field_name="model_served")
    scope = django_filters.CharFilter(method="under_scope", label="Scope path (and below)")
    since = DateTimeFilter(field_name="started_at", lookup_expr="gte")
    until = DateTimeFilter(field_name="started_at", lookup_expr="lt")
    key = django_filters.CharFilter(field_name="key_prefix")

    class Meta:
        model = UsageRecord
        fields = ["request_id", "status", "endpoint", "model", "scope", "since", "until", "key"]

    def under_scope(self, queryset, name, value):
        return queryset.filter(subtree(value.rstrip("/"), "scope_path"))
