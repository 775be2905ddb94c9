"""FilterSets of the tenancy app, shared by the console and the API.

A scope in a filter is written as people write it (``team:acme/ml``) or by id, and is resolved
among the scopes the caller may see: naming a scope outside one's reach reads as "no such scope",
exactly like naming one that does not exist.
"""

from __future__ import annotations

import django_filters
from django import forms
from django.db.models import Q
from django.utils import timezone

from berth.filters import DateTimeFilter
from tenancy import access
from tenancy.access import subtree
from tenancy.models import ApprovalRequest, AuditEvent, Contract, Credential, Membership, Role, Scope, ServiceClient
from tenancy.models.tree import ROLE_RANK
from tenancy.services.tree import resolve_scope


class TenancyFilterSet(django_filters.FilterSet):
    """Resolves written scopes among those the requesting caller may see."""

    def visible_scope(self, written: str) -> Scope:
        caller = getattr(self.request, "user", None)
        return resolve_scope(written, access.visible_to(caller, Scope.objects.all(), ""))


class ScopeFilterSet(TenancyFilterSet):
    q = django_filters.CharFilter(method="filter_q", label="Name or path contains")
    kind = django_filters.ChoiceFilter(choices=Scope.Kind.choices)
    parent = django_filters.CharFilter(method="filter_parent", label="Children of (scope)")
    within = django_filters.CharFilter(method="filter_within", label="At or below (scope)")

    class Meta:
        model = Scope
        fields = ["q", "kind", "parent", "within"]

    def filter_q(self, queryset, name, value):
        return queryset.filter(Q(name__icontains=value) | Q(path__icontains=value))

    def filter_parent(self, queryset, name, value):
        return queryset.filter(parent=self.visible_scope(value))

    def filter_within(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path))


class MembershipFilterSet(TenancyFilterSet):
    scope = django_filters.CharFilter(method="filter_scope", label="On (scope)")
    within = django_filters.CharFilter(method="filter_within", label="At or below (scope)")
    user = django_filters.CharFilter(field_name="user__username", lookup_expr="iexact", label="Username")
    role = django_filters.ChoiceFilter(choices=Role.choices)

    class Meta:
        model = Membership
        fields = ["scope", "within", "user", "role"]

    def filter_scope(self, queryset, name, value):
        return queryset.filter(scope=self.visible_scope(value))

    def filter_within(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path, "scope__path"))


class ServiceClientFilterSet(TenancyFilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    project = django_filters.CharFilter(method="filter_project", label="In (scope)")
    environment = django_filters.ChoiceFilter(choices=ServiceClient.Environment.choices)
    access = django_filters.ChoiceFilter(choices=ServiceClient.Access.choices)
    priority = django_filters.ChoiceFilter(choices=ServiceClient.Priority.choices)
    is_active = django_filters.BooleanFilter()

    class Meta:
        model = ServiceClient
        fields = ["q", "project", "environment", "access", "priority", "is_active"]

    def filter_project(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path, "project__path"))


class CredentialFilterSet(TenancyFilterSet):
    STATES = (("active", "Active"), ("expired", "Expired"), ("revoked", "Revoked"))

    client = django_filters.UUIDFilter(field_name="client__public_id", label="Client id")
    project = django_filters.CharFilter(method="filter_project", label="In (scope)")
    state = django_filters.ChoiceFilter(choices=STATES, method="filter_state")

    class Meta:
        model = Credential
        fields = ["client", "project", "state"]

    def filter_project(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path, "client__project__path"))

    def filter_state(self, queryset, name, value):
        now = timezone.now()
        if value == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if value == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now), revoked_at__isnull=True)


class ContractFilterSet(TenancyFilterSet):
    scope = django_filters.CharFilter(method="filter_scope", label="At or below (scope)")

    class Meta:
        model = Contract
        fields = ["scope"]

    def filter_scope(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path, "scope__path"))


class ApprovalRequestFilterSet(TenancyFilterSet):
    BOXES = (("mine", "Mine, waiting"), ("to_decide", "For me to decide"), ("decided", "Decided"))

    box = django_filters.ChoiceFilter(choices=BOXES, method="filter_box", label="Box")
    status = django_filters.ChoiceFilter(choices=ApprovalRequest.Status.choices)
    action = django_filters.CharFilter()
    scope = django_filters.CharFilter(method="filter_scope", label="At or below (scope)")

    class Meta:
        model = ApprovalRequest
        fields = ["box", "status", "action", "scope"]

    def filter_scope(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path, "scope__path"))

    def filter_box(self, queryset, name, value):
        caller = getattr(self.request, "user", None)
        user_id = caller.pk if caller is not None and not isinstance(caller, ServiceClient) else None
        pending = Q(status=ApprovalRequest.Status.PENDING)
        if value == "mine":
            return queryset.filter(pending, requested_by_id=user_id)
        if value == "decided":
            return queryset.exclude(pending)
        # To decide: pending, not expired, asked by someone else, on a scope where the caller may decide.
        queryset = queryset.filter(pending, expires_at__gt=timezone.now()).exclude(requested_by_id=user_id)
        if user_id is None:
            return queryset.none()  # service clients do not decide
        if access.is_superuser(caller):
            return queryset
        needed = ROLE_RANK[access.ACTIONS["decide"]]
        deciding = [path for path, role in access.roles(caller).items() if ROLE_RANK[role] >= needed]
        condition = Q()
        for path in deciding:
            condition |= subtree(path, "scope__path")
        return queryset.filter(condition) if deciding else queryset.none()


# The console's form shows a date-time picker; the API reads any ISO 8601 moment.
PICKER = {"type": "datetime-local"}


class AuditEventFilterSet(TenancyFilterSet):
    """The audit log's filters: the console's audit page and its download, and the API's list and
    export, read the same parameters the same way."""

    actor = django_filters.CharFilter(method="filter_actor", label="Actor",
                                      help_text="user:name, client:…, or a username")
    action = django_filters.CharFilter(method="filter_action", label="Action",
                                       help_text="e.g. credential.revoke, or credential for every credential.…")
    scope = django_filters.CharFilter(method="filter_scope", label="Scope",
                                      help_text="org:…, team:…, project:…, a path or an id; it and all below it")
    object = django_filters.CharFilter(field_name="object_id", label="Object id")
    since = DateTimeFilter(field_name="at", lookup_expr="gte", label="From", widget=forms.DateTimeInput(PICKER))
    until = DateTimeFilter(field_name="at", lookup_expr="lt", label="Until", widget=forms.DateTimeInput(PICKER))

    class Meta:
        model = AuditEvent
        fields = ["actor", "action", "scope", "object", "since", "until"]

    def filter_actor(self, queryset, name, value):
        value = value.strip()
        return queryset.filter(Q(actor__iexact=value) | Q(actor__iexact=f"user:{value}"))

    def filter_action(self, queryset, name, value):
        value = value.strip().rstrip(".")
        return queryset.filter(Q(action=value) | Q(action__startswith=value + "."))

    def filter_scope(self, queryset, name, value):
        return queryset.filter(subtree(self.visible_scope(value).path, "scope_path"))
