"""The tenancy management API. Views parse, call a service, and render: every permission check and
every audit event happens inside the services, and every queryset is narrowed to the caller's reach
by ``TenancyViewSet`` before any handler runs."""

from __future__ import annotations

import json
from datetime import timedelta

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, renderers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from berth.errors import InvalidInput
from tenancy import access, exports, filtersets
from tenancy.api import serializers as s
from tenancy.api.base import TenancyViewSet
from tenancy.errors import ScopeNotFound
from tenancy.models import ApprovalRequest, AuditEvent, Contract, Credential, Membership, Scope, ServiceClient
from tenancy.services import approvals, clients, contracts, members, tree


# --- the tree ---------------------------------------------------------------------------------------

@extend_schema_view(
    create=extend_schema(request=s.ScopeCreateSerializer, responses={201: s.ScopeSerializer}),
    partial_update=extend_schema(request=s.ScopeRenameSerializer, responses=s.ScopeSerializer),
)
class ScopeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Organisations, teams and projects. Creating an organisation takes a Berth administrator;
    a team or project takes admin of its parent; renaming, admin; deleting, owner."""

    queryset = Scope.objects.select_related("parent")
    serializer_class = s.ScopeSerializer
    filterset_class = filtersets.ScopeFilterSet
    scope_field = ""
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def list(self, request, *args, **kwargs):
        queryset = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(queryset)
        rows = page if page is not None else list(queryset)
        # Holdings of the whole page in one query rather than one per row.
        held = contracts.holdings_by_path([scope.path for scope in rows])
        data = s.ScopeSerializer(rows, many=True, context=self.get_serializer_context() | {"holdings": held}).data
        return self.get_paginated_response(data) if page is not None else Response(data)

    def create(self, request):
        data = self.parsed(s.ScopeCreateSerializer)
        scope = tree.create_scope(self.actor, data["kind"], data["slug"], data["name"], data["parent"])
        return self.render(scope, status_code=status.HTTP_201_CREATED)

    def partial_update(self, request, public_id=None):
        scope = tree.rename_scope(self.actor, self.get_object(), self.parsed(s.ScopeRenameSerializer)["name"])
        return self.render(scope)

    def destroy(self, request, public_id=None):
        tree.delete_scope(self.actor, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(parameters=[OpenApiParameter("scope", str, required=True,
                                                description="org:acme, team:acme/ml, project:acme/ml/search or an id")],
                   responses=s.ScopeSerializer)
    @action(detail=False, methods=["get"])
    def resolve(self, request):
        """The scope that a written form names, among those the caller may see."""
        written = request.query_params.get("scope", "")
        return self.render(tree.resolve_scope(written, self.get_queryset()))


# --- people -----------------------------------------------------------------------------------------

@extend_schema_view(
    create=extend_schema(request=s.MembershipCreateSerializer, responses={201: s.MembershipSerializer}),
    partial_update=extend_schema(request=s.MembershipRoleSerializer, responses=s.MembershipSerializer),
)
class MembershipViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Who holds which role where. Admins manage memberships below owner; only owners grant or
    remove ownership."""

    queryset = Membership.objects.select_related("user", "scope")
    serializer_class = s.MembershipSerializer
    filterset_class = filtersets.MembershipFilterSet
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def create(self, request):
        data = self.parsed(s.MembershipCreateSerializer)
        # The scope resolved first (among those the caller sees): an outsider learns nothing of users.
        membership = members.add_member(self.actor, data["scope"], members.find_user(data["username"]), data["role"])
        return self.render(membership, status_code=status.HTTP_201_CREATED)

    def partial_update(self, request, public_id=None):
        membership = members.change_role(self.actor, self.get_object(), self.parsed(s.MembershipRoleSerializer)["role"])
        return self.render(membership)

    def destroy(self, request, public_id=None):
        members.remove_member(self.actor, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- service clients and keys -----------------------------------------------------------------------

@extend_schema_view(
    create=extend_schema(request=s.ServiceClientCreateSerializer, responses={201: s.ServiceClientSerializer}),
    partial_update=extend_schema(request=s.ServiceClientUpdateSerializer, responses=s.ServiceClientSerializer),
)
class ServiceClientViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Machine identities of projects; members of a project manage its clients, admins those with
    management access (and their keys)."""

    queryset = ServiceClient.objects.select_related("project", "granted_by")
    serializer_class = s.ServiceClientSerializer
    filterset_class = filtersets.ServiceClientFilterSet
    scope_field = "project"
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def create(self, request):
        data = dict(self.parsed(s.ServiceClientCreateSerializer))
        client = clients.create_client(self.actor, data.pop("project"), data.pop("name"), **data)
        return self.render(client, status_code=status.HTTP_201_CREATED)

    def partial_update(self, request, public_id=None):
        fields = self.parsed(s.ServiceClientUpdateSerializer, partial=True)
        return self.render(clients.update_client(self.actor, self.get_object(), **fields))

    def destroy(self, request, public_id=None):
        clients.delete_client(self.actor, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema_view(
    create=extend_schema(request=s.CredentialCreateSerializer, responses={201: s.NewCredentialSerializer}),
)
class CredentialViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """API keys. The plaintext of a key is in the answer to creating (or rotating) it and nowhere
    else, ever; lists show its prefix."""

    queryset = Credential.objects.select_related("client__project", "created_by", "replaces")
    serializer_class = s.CredentialSerializer
    filterset_class = filtersets.CredentialFilterSet
    scope_field = "client__project"

    def _created(self, credential: Credential, plaintext: str) -> Response:
        credential.key = plaintext  # on this one response object only; never stored
        return self.render(credential, s.NewCredentialSerializer, status.HTTP_201_CREATED)

    def create(self, request):
        data = self.parsed(s.CredentialCreateSerializer)
        client = get_object_or_404(access.visible_to(request.user, ServiceClient.objects.select_related("project"),
                                                     "project"), public_id=data["client"])
        lifetime = timedelta(days=data["lifetime_days"]) if data["lifetime_days"] else None
        credential, plaintext = clients.create_credential(
            self.actor, client, name=data["name"], lifetime=lifetime, approval=data["approval"],
            **{name: data[name] for name in clients.KEY_LIMITS})
        return self._created(credential, plaintext)

    @extend_schema(request=None, responses=s.CredentialSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, public_id=None):
        """Stop the key working, at once. Revoking a revoked key changes nothing."""
        return self.render(clients.revoke_credential(self.actor, self.get_object()))

    @extend_schema(request=s.CredentialRotateSerializer, responses={201: s.NewCredentialSerializer})
    @action(detail=True, methods=["post"])
    def rotate(self, request, public_id=None):
        """A new key for the same client; the old one keeps working for ``overlap_hours``."""
        overlap = timedelta(hours=self.parsed(s.CredentialRotateSerializer)["overlap_hours"])
        credential, plaintext = clients.rotate_credential(self.actor, self.get_object(), overlap)
        return self._created(credential, plaintext)


# --- contracts --------------------------------------------------------------------------------------

SCOPE_ID = OpenApiParameter("scope_id", OpenApiTypes.UUID, OpenApiParameter.PATH,
                            description="The id of the scope whose contract this is.")


@extend_schema_view(
    retrieve=extend_schema(parameters=[SCOPE_ID]),
    update=extend_schema(parameters=[SCOPE_ID], request=s.ContractSetSerializer, responses=s.ContractSerializer),
    partial_update=extend_schema(parameters=[SCOPE_ID], request=s.ContractSetSerializer,
                                 responses=s.ContractSerializer),
)
class ContractViewSet(mixins.ListModelMixin, TenancyViewSet):
    """Capacity contracts, addressed by their scope's id: ``/contracts/<scope id>/`` reads (an empty
    contract when the scope has none yet) and sets them. PUT sets every figure (absent ones are
    cleared); PATCH only those given. Raising or removing a limit, softening a hard budget and raising
    or setting a guarantee need an approved request."""

    queryset = Contract.objects.select_related("scope")
    serializer_class = s.ContractSerializer
    filterset_class = filtersets.ContractFilterSet
    lookup_field = "scope__public_id"
    lookup_url_kwarg = "scope_id"
    http_method_names = ["get", "post", "put", "patch", "head", "options"]

    def scope(self) -> Scope:
        scope = self.visible_scopes().filter(public_id=self.kwargs["scope_id"]).first()
        if scope is None:
            raise ScopeNotFound("No such scope, or it is outside your reach.")
        return scope

    def retrieve(self, request, scope_id=None):
        scope = self.scope()
        return self.render(Contract.objects.filter(scope=scope).select_related("scope").first() or Contract(scope=scope))

    def update(self, request, scope_id=None, partial=False):
        figures = dict(self.parsed(s.ContractSetSerializer, partial=partial))
        approval = figures.pop("approval", None)
        if not partial:  # PUT: what is not given is cleared
            figures = {name: None for name in s.FIGURE_NAMES} | {"budget_mode": Contract.BudgetMode.HARD} | figures
        contract = contracts.set_contract(self.actor, self.scope(), approval=approval, **figures)
        return self.render(contract)

    def partial_update(self, request, scope_id=None):
        return self.update(request, scope_id, partial=True)

    @extend_schema(request=s.CapacityCheckSerializer, responses=s.VerdictSerializer)
    @action(detail=False, methods=["post"])
    def check(self, request):
        """Whether adding capacity under a scope stays within every limit on its chain; each refusal
        names the scope and the figure."""
        data = dict(self.parsed(s.CapacityCheckSerializer))
        verdict = contracts.check_addition(data.pop("scope"), **data)
        return Response(s.VerdictSerializer({"fits": verdict.fits, "refusals": verdict.refusals}).data)

    @extend_schema(parameters=[OpenApiParameter("scope", str, required=True,
                                                description="org:acme, team:acme/ml, project:acme/ml/search or an id")],
                   responses=s.ContractSerializer(many=True))
    @action(detail=False, methods=["get"], filter_backends=[], pagination_class=None)
    def chain(self, request):
        """The contracts that limit a scope, nearest first: its own, then its ancestors' — those of
        scopes the caller may view, as reading each contract directly (and the console) would answer."""
        scope = tree.resolve_scope(request.query_params.get("scope", ""), self.visible_scopes())
        chain = contracts.visible_chain(request.user, scope)
        return Response(s.ContractSerializer(chain, many=True, context=self.get_serializer_context()).data)


# --- approvals --------------------------------------------------------------------------------------

@extend_schema_view(
    create=extend_schema(request=s.ApprovalAskSerializer, responses={201: s.ApprovalRequestSerializer}),
)
class ApprovalRequestViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """Four-eyes approvals: ask (members), approve or reject (admins, never the asker). The evidence
    is always rebuilt here from the current state, never taken from the caller."""

    queryset = ApprovalRequest.objects.select_related("scope", "requested_by", "decided_by")
    serializer_class = s.ApprovalRequestSerializer
    filterset_class = filtersets.ApprovalRequestFilterSet

    def create(self, request):
        data = self.parsed(s.ApprovalAskSerializer)
        action_name = data["action"]
        subjects = {"contract.raise_limit": self._raise_limit, "credential.create_production": self._production_key}
        if action_name in approvals.POLICIES and action_name not in subjects:
            raise InvalidInput(f"Approvals for {action_name} are asked for where that action happens.",
                               details={"action": "not requestable here"})
        if action_name not in subjects:
            raise InvalidInput(f"{action_name!r} needs no approval.",
                               details={"action": f"one of {', '.join(sorted(approvals.POLICIES))}"})
        scope, subject, evidence_now = subjects[action_name](data)
        # Who may ask, before anything about the evidence: a viewer gets a 403, not a verdict on it.
        approvals.require_asker(self.actor, action_name, scope)
        approval = approvals.request_approval(self.actor, action_name, scope, subject, evidence_now(), data["reason"],
                                              expected_fingerprint=data.get("fingerprint"))
        return self.render(approval, status_code=status.HTTP_201_CREATED)

    def _raise_limit(self, data):
        """(scope, subject, a function building the evidence): built only once the caller may ask."""
        scope = data.get("scope")
        if scope is None:
            raise InvalidInput("Name the scope whose contract changes.", details={"scope": "required"})

        def evidence():
            proposed = data.get("proposed")
            if proposed is None and data.get("evidence"):
                proposed = data["evidence"].get("proposed")
            if not isinstance(proposed, dict) or not proposed:
                raise InvalidInput("Give the proposed figures (or the evidence of an approval_required answer).",
                                   details={"proposed": "required"})
            return contracts.raise_limit_evidence(scope, **proposed)

        return scope, scope, evidence

    def _production_key(self, data):
        if data.get("subject") is None:
            raise InvalidInput("Name the service client (subject) the production key is for.",
                               details={"subject": "required"})
        client = get_object_or_404(access.visible_to(self.request.user,
                                                     ServiceClient.objects.select_related("project"), "project"),
                                   public_id=data["subject"])

        def evidence():
            if client.environment != ServiceClient.Environment.PRODUCTION:
                raise InvalidInput(f"{client} is not a production client: its keys need no approval.",
                                   details={"subject": "not production"})
            if data.get("scope") is not None and data["scope"] != client.project:
                raise InvalidInput(f"{client} belongs to {client.project.written}, not {data['scope'].written}.",
                                   details={"scope": "not the client's project"})
            return clients.production_evidence(client)

        return client.project, client, evidence

    @extend_schema(request=s.DecisionSerializer, responses=s.ApprovalRequestSerializer)
    @action(detail=True, methods=["post"])
    def approve(self, request, public_id=None):
        reason = self.parsed(s.DecisionSerializer)["reason"]
        return self.render(approvals.decide(self.actor, self.get_object(), True, reason))

    @extend_schema(request=s.DecisionSerializer, responses=s.ApprovalRequestSerializer)
    @action(detail=True, methods=["post"])
    def reject(self, request, public_id=None):
        reason = self.parsed(s.DecisionSerializer)["reason"]
        return self.render(approvals.decide(self.actor, self.get_object(), False, reason))


# --- audit ------------------------------------------------------------------------------------------

class JSONLinesRenderer(renderers.BaseRenderer):
    media_type = exports.MEDIA_TYPE
    format = "jsonl"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        # Only errors reach here (the export streams its own body): one line of the error object.
        return (json.dumps(data, default=str) + "\n").encode() if data is not None else b""


class AuditEventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TenancyViewSet):
    """The audit log, read-only. A caller sees the events of the scopes where they hold a role and
    of everything below them."""

    queryset = AuditEvent.objects.all()
    serializer_class = s.AuditEventSerializer
    filterset_class = filtersets.AuditEventFilterSet

    def narrow(self, queryset):
        # Events keep their scope's path (the scope may be gone since), so narrow by that path.
        return access.visible_by_path(self.request.user, queryset, "scope_path")

    @extend_schema(filters=True, responses={(200, "application/x-ndjson"): OpenApiResponse(
        response=OpenApiTypes.STR, description="One audit event per line, as the list shows them, oldest first.")})
    @action(detail=False, methods=["get"], renderer_classes=[JSONLinesRenderer, renderers.JSONRenderer],
            pagination_class=None)
    def export(self, request):
        """Every event the filters select, as JSON lines (oldest first), streamed: the console's
        download writes the same file."""
        return exports.audit_export(self.filter_queryset(self.get_queryset()))
