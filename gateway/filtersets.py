"""FilterSets of the gateway app, shared by the console and the API."""

import django_filters

from berth.filters import DateTimeFilter
from gateway.models import UsageRecord


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
        from django.db.models import Q

        return queryset.filter(Q(scope_path=value) | Q(scope_path__startswith=value.rstrip("/") + "/"))
