"""Serializers of the tenancy API: output shapes, and input shapes that only parse.

Input serializers check types and presence; every rule about the tree, roles, keys and contracts
is the services' (they raise errors with stable codes). Objects are named by their public id, and
scopes also as people write them (``project:acme/ml/search``).
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tenancy import access
from tenancy.models import ApprovalRequest, AuditEvent, Contract, Credential, Membership, Role, Scope, ServiceClient
from tenancy.models.contracts import CAPACITY_FIGURES, RATE_FIGURES
from tenancy.services import contracts as contract_services
from tenancy.services.tree import resolve_scope


class WrittenScopeField(serializers.CharField):
    """A scope as people write it (``team:acme/ml``) or its id, resolved among the scopes the caller
    may see: one outside their reach is "no such scope" (404), as if it did not exist."""

    def __init__(self, **kwargs):
        kwargs.setdefault("help_text", "A scope: org:acme, team:acme/ml, project:acme/ml/search, or its id.")
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        text = super().to_internal_value(data)
        caller = getattr(self.context.get("request"), "user", None)
        return resolve_scope(text, access.visible_to(caller, Scope.objects.all(), ""))


@extend_schema_field({"type": "string", "enum": list(Scope.Kind.values)}, component_name="ScopeKind")
class ScopeKindField(serializers.ChoiceField):
    """A scope's kind (an inline enum in the schema: "kind" names other enums elsewhere)."""

    def __init__(self, **kwargs):
        super().__init__(choices=Scope.Kind.choices, **kwargs)


CREDENTIAL_STATES = ("active", "expired", "revoked")


@extend_schema_field({"type": "string", "enum": list(CREDENTIAL_STATES)}, component_name="CredentialState")
class CredentialStateField(serializers.Field):
    """Whether a key works now: active, expired or revoked (revoked wins)."""

    def __init__(self, **kwargs):
        super().__init__(source="*", read_only=True, **kwargs)

    def to_representation(self, credential: Credential) -> str:
        if credential.revoked_at is not None:
            return "revoked"
        if credential.expires_at is not None and credential.expires_at <= timezone.now():
            return "expired"
        return "active"


class HoldingsSerializer(serializers.Serializer):
    gpu_memory_gib = serializers.DecimalField(max_digits=14, decimal_places=2)
    gpus = serializers.DecimalField(max_digits=14, decimal_places=2)
    cores = serializers.DecimalField(max_digits=14, decimal_places=2)


# --- the tree ---------------------------------------------------------------------------------------

class ScopeSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    written = serializers.CharField(read_only=True)
    parent = serializers.UUIDField(source="parent.public_id", read_only=True, allow_null=True, default=None)
    kind = ScopeKindField(read_only=True)
    holdings = serializers.SerializerMethodField()

    class Meta:
        model = Scope
        fields = ["id", "kind", "slug", "name", "path", "written", "parent", "created_at", "holdings"]

    @extend_schema_field(HoldingsSerializer)
    def get_holdings(self, scope: Scope) -> dict:
        # Lists pass every row's holdings at once (one query for the page); a single scope asks alone.
        known = self.context.get("holdings") or {}
        held = known.get(scope.path) or contract_services.holdings(scope)
        return HoldingsSerializer(held).data


class ScopeCreateSerializer(serializers.Serializer):
    kind = ScopeKindField()
    slug = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    parent = WrittenScopeField(required=False, allow_null=True, default=None)


class ScopeRenameSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)


# --- people -----------------------------------------------------------------------------------------

class MembershipSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    user = serializers.CharField(source="user.username", read_only=True)
    scope = serializers.UUIDField(source="scope.public_id", read_only=True)
    scope_written = serializers.CharField(source="scope.written", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "user", "scope", "scope_written", "role", "created_at"]


class MembershipCreateSerializer(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    scope = WrittenScopeField()
    role = serializers.ChoiceField(choices=Role.choices)


class MembershipRoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Role.choices)


# --- service clients and keys -----------------------------------------------------------------------

class ServiceClientSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    project = serializers.UUIDField(source="project.public_id", read_only=True)
    project_written = serializers.CharField(source="project.written", read_only=True)
    granted_by = serializers.CharField(
        source="granted_by.username", read_only=True, allow_null=True, default=None,
        help_text="Who gave it management access: it never acts above their role on its project (unset: Berth).")

    class Meta:
        model = ServiceClient
        fields = ["id", "project", "project_written", "name", "description", "all_models", "allowed_models",
                  "environment", "access", "granted_by", "rpm_limit", "tpm_limit", "concurrency_limit", "priority",
                  "is_active", "created_at"]


class _ClientFields(serializers.Serializer):
    description = serializers.CharField(max_length=300, required=False, allow_blank=True)
    all_models = serializers.BooleanField(required=False)
    allowed_models = serializers.ListField(child=serializers.CharField(max_length=200), required=False)
    environment = serializers.ChoiceField(choices=ServiceClient.Environment.choices, required=False)
    access = serializers.ChoiceField(choices=ServiceClient.Access.choices, required=False)
    rpm_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    tpm_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    concurrency_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    priority = serializers.ChoiceField(choices=ServiceClient.Priority.choices, required=False)
    is_active = serializers.BooleanField(required=False)


class ServiceClientCreateSerializer(_ClientFields):
    project = WrittenScopeField()
    name = serializers.CharField(max_length=100)


class ServiceClientUpdateSerializer(_ClientFields):
    """What may change after creation (a client's project and name are its identity)."""


class CredentialSerializer(serializers.ModelSerializer):
    """A key as it may be shown: never its secret, never a hash."""

    id = serializers.UUIDField(source="public_id", read_only=True)
    client = serializers.UUIDField(source="client.public_id", read_only=True)
    client_written = serializers.CharField(source="client.__str__", read_only=True)
    prefix = serializers.CharField(read_only=True)
    created_by = serializers.CharField(source="created_by.username", read_only=True, allow_null=True, default=None)
    lifetime_days = serializers.SerializerMethodField()
    state = CredentialStateField()
    replaces = serializers.UUIDField(source="replaces.public_id", read_only=True, allow_null=True, default=None)

    class Meta:
        model = Credential
        fields = ["id", "client", "client_written", "name", "prefix", "state", "created_by", "created_at",
                  "lifetime_days", "expires_at", "revoked_at", "last_used_at", "replaces", "rpm_limit", "tpm_limit",
                  "concurrency_limit"]

    def get_lifetime_days(self, credential: Credential) -> float | None:
        return credential.lifetime.total_seconds() / 86400 if credential.lifetime else None


class NewCredentialSerializer(CredentialSerializer):
    """The answer to creating or rotating a key: the only time its plaintext is ever shown."""

    key = serializers.CharField(read_only=True, help_text="The key itself. Shown once: store it now.")

    class Meta(CredentialSerializer.Meta):
        fields = CredentialSerializer.Meta.fields + ["key"]


class CredentialCreateSerializer(serializers.Serializer):
    client = serializers.UUIDField(help_text="The service client's id.")
    name = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")
    lifetime_days = serializers.IntegerField(min_value=1, max_value=3650, required=False, allow_null=True,
                                             default=None, help_text="Unset: the key does not expire.")
    approval = serializers.UUIDField(required=False, allow_null=True, default=None,
                                     help_text="An approved request's id (production clients' keys need one).")
    rpm_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)
    tpm_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)
    concurrency_limit = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)


class CredentialRotateSerializer(serializers.Serializer):
    overlap_hours = serializers.IntegerField(min_value=0, max_value=30 * 24, required=False, default=24,
                                             help_text="How long the old key keeps working.")


# --- contracts --------------------------------------------------------------------------------------

def _amount(**kwargs):
    return serializers.DecimalField(max_digits=12, decimal_places=2, min_value=0, allow_null=True, **kwargs)


def _count(**kwargs):
    return serializers.IntegerField(min_value=0, allow_null=True, **kwargs)


def _figure_fields(**kwargs) -> dict:
    fields = {}
    for stem, _, _ in CAPACITY_FIGURES:
        fields[f"{stem}_guarantee"] = _amount(**kwargs)
        fields[f"{stem}_limit"] = _amount(**kwargs)
    for stem, _, _ in RATE_FIGURES:
        fields[stem] = _count(**kwargs)
    fields["budget_mode"] = serializers.ChoiceField(choices=Contract.BudgetMode.choices, **kwargs)
    return fields


FIGURE_NAMES = tuple(_figure_fields())

ContractFigures = type("ContractFigures", (serializers.Serializer,), _figure_fields(required=False))


class ContractSerializer(serializers.ModelSerializer):
    id = serializers.SerializerMethodField()
    scope = serializers.UUIDField(source="scope.public_id", read_only=True)
    scope_written = serializers.CharField(source="scope.written", read_only=True)

    class Meta:
        model = Contract
        fields = ["id", "scope", "scope_written", *FIGURE_NAMES, "updated_at"]

    def get_id(self, contract: Contract) -> str | None:
        # A scope without a contract reads as an unsaved, empty one: it has no id yet.
        return str(contract.public_id) if contract.pk else None


class ContractSetSerializer(ContractFigures):
    approval = serializers.UUIDField(required=False, allow_null=True, default=None,
                                     help_text="An approved request's id (raising or removing a limit, softening a "
                                               "hard budget or raising a guarantee needs one).")


class CapacityCheckSerializer(serializers.Serializer):
    scope = WrittenScopeField()
    gpu_memory_gib = serializers.DecimalField(max_digits=12, decimal_places=2, min_value=0, required=False, default=0)
    gpus = serializers.DecimalField(max_digits=12, decimal_places=2, min_value=0, required=False, default=0)
    cores = serializers.DecimalField(max_digits=12, decimal_places=2, min_value=0, required=False, default=0)


class RefusalSerializer(serializers.Serializer):
    scope = serializers.CharField()
    figure = serializers.CharField()
    held = serializers.DecimalField(max_digits=14, decimal_places=2)
    asked = serializers.DecimalField(max_digits=14, decimal_places=2)
    limit = serializers.DecimalField(max_digits=14, decimal_places=2)
    message = serializers.CharField()


class VerdictSerializer(serializers.Serializer):
    fits = serializers.BooleanField()
    refusals = RefusalSerializer(many=True)


# --- approvals --------------------------------------------------------------------------------------

class ApprovalRequestSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    scope = serializers.UUIDField(source="scope.public_id", read_only=True)
    scope_written = serializers.CharField(source="scope.written", read_only=True)
    requested_by = serializers.CharField(source="requested_by.username", read_only=True)
    decided_by = serializers.CharField(source="decided_by.username", read_only=True, allow_null=True, default=None)

    class Meta:
        model = ApprovalRequest
        fields = ["id", "scope", "scope_written", "action", "subject_type", "subject_id", "subject_repr",
                  "requested_by", "reason", "evidence", "fingerprint", "status", "decided_by", "decided_at",
                  "decision_reason", "created_at", "expires_at", "used_at"]


class ApprovalAskSerializer(serializers.Serializer):
    action = serializers.CharField(max_length=100, help_text="contract.raise_limit or credential.create_production.")
    reason = serializers.CharField()
    scope = WrittenScopeField(required=False, help_text="contract.raise_limit: the scope whose contract changes.")
    subject = serializers.UUIDField(required=False, help_text="credential.create_production: the client's id.")
    proposed = serializers.DictField(required=False, help_text="contract.raise_limit: the figures to set.")
    evidence = serializers.DictField(required=False,
                                     help_text="The evidence of an approval_required error, submitted as it came: "
                                               "its proposed figures are used, the rest is rebuilt.")
    fingerprint = serializers.CharField(required=False, max_length=64,
                                        help_text="The fingerprint of an approval_required error: refused if the "
                                                  "evidence rebuilt now differs (something changed since).")


class DecisionSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


# --- audit ------------------------------------------------------------------------------------------

class AuditEventSerializer(serializers.ModelSerializer):
    id = serializers.UUIDField(source="public_id", read_only=True)
    scope = serializers.SerializerMethodField()

    class Meta:
        model = AuditEvent
        fields = ["id", "at", "actor", "action", "object_type", "object_id", "object_repr", "scope", "details",
                  "address"]

    def get_scope(self, event: AuditEvent) -> str:
        """The path of the scope as it was when the event happened (kept after the scope is gone)."""
        return event.scope_path
