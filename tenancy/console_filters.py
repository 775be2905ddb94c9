"""Console FilterSets of the tenancy app (to be merged into ``filtersets.py``, which the API's
FilterSets are being written in, so that one FilterSet per model serves both)."""

import django_filters
from django import forms
from django.db.models import Q

from tenancy.models import AuditEvent


class AuditEventFilterSet(django_filters.FilterSet):
    actor = django_filters.CharFilter(field_name="actor", lookup_expr="icontains", label="Actor")
    action = django_filters.CharFilter(method="filter_action", label="Action",
                                       help_text="e.g. credential or credential.revoke")
    scope = django_filters.CharFilter(method="filter_scope", label="Scope",
                                      help_text="a path, or written as org:…, team:…, project:…; it and all below it")
    since = django_filters.DateTimeFilter(field_name="at", lookup_expr="gte", label="From",
                                          widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))
    until = django_filters.DateTimeFilter(field_name="at", lookup_expr="lt", label="Until",
                                          widget=forms.DateTimeInput(attrs={"type": "datetime-local"}))

    class Meta:
        model = AuditEvent
        fields = ["actor", "action", "scope", "since", "until"]

    def filter_action(self, queryset, name, value):
        value = value.strip()
        # "credential" finds credential.create, .revoke, …; "credential.revoke" finds exactly that.
        return queryset.filter(Q(action=value) | Q(action__startswith=value.rstrip(".") + "."))

    def filter_scope(self, queryset, name, value):
        path = value.strip().partition(":")[2] if ":" in value else value.strip()
        path = path.strip("/").lower()
        return queryset.filter(Q(scope_path=path) | Q(scope_path__startswith=path + "/"))
