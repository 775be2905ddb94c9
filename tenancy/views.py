"""The tenancy console: the tree, people, service clients and keys, contracts, approvals, audit.

Views are declarations over the console's bases (``tenancy.console``: ``ConsoleMixin``, ``ConsolePage``,
``ObjectAction``). Services check permissions and write the audit log: views never write rows.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Count, Q
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.views import View

from berth.errors import BerthError, InvalidInput, NotFound, PermissionDenied
from tenancy import access
from tenancy.console import ConsoleMixin, ConsolePage, ObjectAction, filtered, first_error, scope_crumbs
from tenancy.errors import ApprovalRequired, InvalidContract
from tenancy.exports import audit_export
from tenancy.filtersets import AuditEventFilterSet
from tenancy.forms import (AskApprovalForm, ClientForm, ContractForm, DecideForm, KeyForm, MemberAddForm, RoleForm,
                           RotateForm, ScopeCreateForm)
from tenancy.models import ApprovalRequest, AuditEvent, Contract, Credential, Membership, Scope, ServiceClient
from tenancy.services import approvals as approval_service
from tenancy.services import clients as client_service
from tenancy.services import contracts as contract_service
from tenancy.services import members as member_service
from tenancy.services import tree as tree_service
from tenancy.tables import (AuditTable, ClientTable, ContractChainTable, CredentialTable, MembershipTable, ScopeTable,
                            bars)

CHILD_KIND = {Scope.Kind.ORG: Scope.Kind.TEAM, Scope.Kind.TEAM: Scope.Kind.PROJECT}


def scope_url(scope) -> str:
    return reverse("tenancy:scope", args=[scope.public_id])


def client_url(client) -> str:
    return reverse("tenancy:client", args=[client.public_id])


# A record's trail after Organisations (the navigation's, berth/breadcrumbs.html): the list it belongs to.
def tree_crumbs() -> list[tuple[str, str]]:
    return [("Tree", reverse("tenancy:index"))]


def client_crumbs(request, client) -> list[tuple[str, str]]:
    return [("Service clients", reverse("tenancy:clients")),
            *scope_crumbs(request.user, client.project), (client.name, client_url(client))]


def with_tree_figures(scopes) -> list[Scope]:
    """Give each scope its depth (relative to the shallowest shown) and its holdings bars."""
    scopes = list(scopes)
    if not scopes:
        return scopes
    held = contract_service.holdings_by_path([s.path for s in scopes])
    contracts = {c.scope_id: c for c in Contract.objects.filter(scope__in=scopes)}
    top = min(s.path.count("/") for s in scopes)
    for scope in scopes:
        scope.depth = scope.path.count("/") - top
        scope.bars = bars(contracts.get(scope.pk), held[scope.path])
    return scopes


# The tree and a scope --------------------------------------------------------------------------------

class TreeView(ConsolePage):
    """Every visible scope, one line each, with what it holds against its guarantee and limit."""

    model = Scope
    scope_field = ""
    template_name = "tenancy/tree.html"
    fragment_template_name = "tenancy/tree_table.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["table"] = ScopeTable(with_tree_figures(self.get_queryset()), caller=self.request.user)
        return context


class ScopeView(ConsolePage):
    model = Scope
    scope_field = ""
    template_name = "tenancy/scope.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        scope, user = self.get_object(), self.request.user
        children = self.get_queryset().filter(parent=scope)
        memberships = Membership.objects.filter(scope=scope).select_related("user", "scope")
        clients = (access.visible_to(user, ServiceClient.objects.all(), "project")
                   .filter(access.subtree(scope.path, "project__path"))
                   .select_related("project").annotate(working_keys=_working_keys()))
        chain = contract_service.visible_chain(user, scope)
        context.update(
            scope=scope, child_kind=CHILD_KIND.get(scope.kind),
            may_change=self.may("change", scope), may_use=self.may("use", scope),
            children=ScopeTable(with_tree_figures([scope, *children]), caller=user),
            members=MembershipTable(memberships, caller=user, empty_message="No one has a role on this scope itself."),
            clients=ClientTable(clients, caller=user),
            chain=ContractChainTable(chain, caller=user),
            scope_form=ScopeCreateForm(), member_form=MemberAddForm(),
            breadcrumbs=[*tree_crumbs(), *scope_crumbs(user, scope)],
        )
        return context


def _working_keys():
    now = timezone.now()
    return Count("credentials", filter=Q(credentials__revoked_at__isnull=True)
                 & (Q(credentials__expires_at__isnull=True) | Q(credentials__expires_at__gt=now)))


class ScopeCreateView(ObjectAction):
    """A child of a visible scope (a team of an organisation, a project of a team)."""

    model = Scope
    scope_field = ""
    form_class = ScopeCreateForm

    def perform(self, parent, data):
        kind = CHILD_KIND.get(parent.kind)
        if kind is None:
            raise InvalidInput("Projects have no children.")
        child = tree_service.create_scope(self.actor, kind, data["slug"], data["name"], parent=parent)
        messages.success(self.request, f"Created {child.written}.")
        return child

    def success_url(self, parent, child):
        return scope_url(child or parent)


# People --------------------------------------------------------------------------------------------

class PeopleView(ConsolePage):
    model = Membership
    queryset = Membership.objects.select_related("user", "scope")
    template_name = "tenancy/people.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        user = self.request.user
        manageable = [s for s in access.visible_to(user, Scope.objects.all(), "") if access.can(user, "change", s)]
        context.update(table=MembershipTable(self.get_queryset(), caller=user), manageable=manageable,
                       member_form=MemberAddForm())
        return context


class MemberAddView(ObjectAction):
    """Give a person a role on a visible scope (the scope's public id is the form's ``scope``)."""

    model = Scope
    scope_field = ""
    form_class = MemberAddForm

    def get_object(self):
        scope_id = _uuid_or_none(self.request.POST.get("scope"))
        if scope_id is None:
            raise Http404("Which scope?")
        self.kwargs["public_id"] = scope_id
        return super().get_object()

    def perform(self, scope, data):
        # Ask "may you change memberships here?" before looking the person up, so that a viewer
        # cannot use this form to learn which usernames exist.
        access.require(self.actor, "change", scope)
        person = member_service.find_user(data["username"])
        membership = member_service.add_member(self.actor, scope, person, data["role"])
        messages.success(self.request, f"{person.get_username()} is now {membership.get_role_display().lower()} "
                                       f"of {scope.written}.")
        return membership

    def success_url(self, scope, result):
        return scope_url(scope)


class MembershipRowMixin:
    model = Membership
    queryset = Membership.objects.select_related("user", "scope")

    def fragment(self, membership, result, error=None):
        if result is None and error is None:
            return HttpResponse("")  # removed: the row goes
        membership.refresh_from_db(fields=["role"])
        table = MembershipTable([membership], caller=self.request.user)
        return render(self.request, "tenancy/record_row.html",
                      {"table": table, "record": table.records[0], "error": error})

    def success_url(self, membership, result):
        return scope_url(membership.scope)


class MembershipRoleView(MembershipRowMixin, ObjectAction):
    form_class = RoleForm

    def perform(self, membership, data):
        return member_service.change_role(self.actor, membership, data["role"])


class MembershipRemoveView(MembershipRowMixin, ObjectAction):
    def perform(self, membership, data):
        member_service.remove_member(self.actor, membership)
        messages.success(self.request, f"{membership.user.get_username()} no longer has a role on "
                                       f"{membership.scope.written}.")
        return None


# Service clients and keys ----------------------------------------------------------------------------

class ClientListView(ConsolePage):
    model = ServiceClient
    queryset = ServiceClient.objects.select_related("project")
    scope_field = "project"
    template_name = "tenancy/clients.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["table"] = ClientTable(self.get_queryset().annotate(working_keys=_working_keys()),
                                       caller=self.request.user)
        context["may_create"] = any(access.can(self.request.user, "use", p) for p in _projects(self.request.user))
        return context


def _projects(user):
    return access.visible_to(user, Scope.objects.filter(kind=Scope.Kind.PROJECT), "")


class ClientCreateView(ConsoleMixin, View):
    template_name = "tenancy/client_form.html"

    def get(self, request):
        projects = [p for p in _projects(request.user) if access.can(request.user, "use", p)]
        form = ClientForm(projects=_projects(request.user).filter(pk__in=[p.pk for p in projects]),
                          initial={"project": request.GET.get("project")})
        return render(request, self.template_name, {"form": form, "may_create": bool(projects)})

    def post(self, request):
        visible = _projects(request.user)
        # A project outside the caller's reach is a 404, as it is everywhere else.
        if not visible.filter(public_id=_uuid_or_none(request.POST.get("project"))).exists():
            raise Http404("No such project, or it is outside your reach.")
        form = ClientForm(request.POST, projects=visible)
        error = None
        if form.is_valid():
            try:
                client = client_service.create_client(self.actor, form.cleaned_data["project"],
                                                      form.cleaned_data["name"], **form.service_fields())
            except (NotFound, PermissionDenied):
                raise
            except BerthError as refusal:
                error = refusal
            else:
                messages.success(request, f"Created service client {client}. Create its first key below.")
                return HttpResponseRedirect(client_url(client))
        return render(request, self.template_name, {"form": form, "error": error, "may_create": True},
                      status=error.status if error else 400)


def _uuid_or_none(value):
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


class ClientView(ConsolePage):
    model = ServiceClient
    queryset = ServiceClient.objects.select_related("project")
    scope_field = "project"
    template_name = "tenancy/client.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(client_context(self.request, self.get_object()))
        return context


def key_table(request, client) -> CredentialTable:
    keys = client.credentials.select_related("client__project", "created_by", "replaces", "replaced_by")
    return CredentialTable(keys, caller=request.user, client=client)


def client_context(request, client, **extra) -> dict:
    usable = _production_approvals(request.user, client)
    chosen = request.GET.get("approval")
    return {
        "client": client, "keys": key_table(request, client),
        # The key form shows to whoever may mint one (an admin, for a client with management access).
        "may_use": access.can(request.user, client_service.key_action(client), client),
        "key_form": KeyForm(approvals=usable, initial={"approval": chosen}), "rotate_form": RotateForm(),
        "breadcrumbs": client_crumbs(request, client),
        **extra,
    }


def _production_approvals(user, client) -> list[ApprovalRequest]:
    if client.environment != ServiceClient.Environment.PRODUCTION:
        return []
    return list(access.visible_to(user, ApprovalRequest.objects.select_related("decided_by"))
                .filter(action="credential.create_production", subject_id=str(client.public_id),
                        status=ApprovalRequest.Status.APPROVED, expires_at__gt=timezone.now()))


def _approval_offer(error: ApprovalRequired, subject) -> AskApprovalForm:
    """The "ask for approval" form, filled with what the refusal says is needed."""
    return AskApprovalForm(initial={
        "action": error.details["action"], "subject": subject.public_id,
        "evidence": json.dumps(error.details["evidence"], sort_keys=True)})


def _pretty(document) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)


class KeyCreateView(ConsoleMixin, View):
    """Mint a key. The answer is the client's page with the plaintext in it: never a redirect, since
    the plaintext exists only in this one response."""

    http_method_names = ["post"]
    model = ServiceClient
    queryset = ServiceClient.objects.select_related("project")
    scope_field = "project"

    def post(self, request, public_id):
        client = self.get_object()
        form = KeyForm(request.POST, approvals=_production_approvals(request.user, client))
        extra, status = {}, 201
        try:
            if not form.is_valid():
                raise InvalidInput(first_error(form))
            credential, plaintext = client_service.create_credential(
                self.actor, client, name=form.cleaned_data["name"], lifetime=form.lifetime,
                approval=form.cleaned_data.get("approval") or None)
            extra = {"new_key": credential, "plaintext": plaintext}
        except ApprovalRequired as error:
            extra, status = {"error": error, "ask_form": _approval_offer(error, client),
                             "evidence": _pretty(error.details["evidence"])}, error.status
        except (NotFound, PermissionDenied):
            raise
        except BerthError as error:
            extra, status = {"error": error}, error.status
        response = render(request, "tenancy/client.html", client_context(request, client, **extra), status=status)
        response["Cache-Control"] = "no-store"
        return response


class KeyActionMixin:
    model = Credential
    queryset = Credential.objects.select_related("client__project")
    scope_field = "client__project"

    def success_url(self, credential, result):
        return client_url(credential.client)


class KeyRevokeView(KeyActionMixin, ObjectAction):
    def perform(self, credential, data):
        credential = client_service.revoke_credential(self.actor, credential)
        messages.success(self.request, f"Revoked {credential.prefix}: it stops working now.")
        return credential

    def fragment(self, credential, result, error=None):
        table = key_table(self.request, credential.client)
        # The message is for a full page; the swapped row says it all.
        list(messages.get_messages(self.request))
        return render(self.request, "tenancy/record_row.html",
                      {"table": table, "record": table.record_of(credential), "error": error})


class KeyRotateView(ConsoleMixin, View):
    """A new key with an overlap; like creation, the answer carries the new plaintext once."""

    http_method_names = ["post"]
    model = Credential
    queryset = Credential.objects.select_related("client__project")
    scope_field = "client__project"

    def post(self, request, public_id):
        credential = self.get_object()
        form = RotateForm(request.POST)
        extra, status = {}, 201
        try:
            if not form.is_valid():
                raise InvalidInput(first_error(form))
            new, plaintext = client_service.rotate_credential(
                self.actor, credential, overlap=timedelta(hours=form.cleaned_data["overlap_hours"]))
            credential.refresh_from_db()
            extra = {"new_key": new, "plaintext": plaintext, "rotated": credential}
        except (NotFound, PermissionDenied):
            raise
        except BerthError as error:
            extra, status = {"error": error}, error.status
        response = render(request, "tenancy/client.html",
                          client_context(request, credential.client, **extra), status=status)
        response["Cache-Control"] = "no-store"
        return response


# Contracts -----------------------------------------------------------------------------------------

class ContractView(ConsoleMixin, View):
    """Edit a scope's contract through ``set_contract``; its refusals name the figures, and a raise
    that needs approval offers to ask for one with the evidence filled in."""

    model = Scope
    scope_field = ""
    template_name = "tenancy/contract_form.html"

    def _approvals(self, scope):
        return list(access.visible_to(self.request.user, ApprovalRequest.objects.select_related("decided_by"))
                    .filter(action="contract.raise_limit", subject_id=str(scope.public_id),
                            status=ApprovalRequest.Status.APPROVED, expires_at__gt=timezone.now()))

    def _render(self, scope, form, status=200, **extra):
        chain = contract_service.visible_chain(self.request.user, scope)
        crumbs = [*tree_crumbs(), *scope_crumbs(self.request.user, scope),
                  ("Contract", reverse("tenancy:contract", args=[scope.public_id]))]
        return render(self.request, self.template_name,
                      {"scope": scope, "form": form, "chain": ContractChainTable(chain), "breadcrumbs": crumbs,
                       **extra}, status=status)

    def get(self, request, public_id):
        scope = self.get_object()
        access.require(self.actor, "change", scope)
        contract = Contract.objects.filter(scope=scope).first()
        initial = {name: getattr(contract, name) for name in contract_service.FIELDS} if contract else {}
        chosen = self._chosen_approval(scope)
        if chosen is not None:
            # Carrying out an approved change: the figures that were approved, and the approval.
            initial |= {name: value for name, value in chosen.evidence.get("proposed", {}).items()
                        if name in contract_service.FIELDS}
            initial["approval"] = str(chosen.public_id)
        return self._render(scope, ContractForm(initial=initial, approvals=self._approvals(scope)))

    def _chosen_approval(self, scope):
        wanted = _uuid_or_none(self.request.GET.get("approval"))
        if wanted is None:
            return None
        return next((a for a in self._approvals(scope) if a.public_id == wanted), None)

    def post(self, request, public_id):
        scope = self.get_object()
        access.require(self.actor, "change", scope)
        form = ContractForm(request.POST, approvals=self._approvals(scope))
        if not form.is_valid():
            return self._render(scope, form, status=400)
        try:
            contract_service.set_contract(self.actor, scope, approval=form.cleaned_data.get("approval") or None,
                                          **form.figures())
        except ApprovalRequired as error:
            return self._render(scope, form, status=error.status, error=error,
                                ask_form=_approval_offer(error, scope), evidence=_pretty(error.details["evidence"]))
        except InvalidContract as error:
            for name, problem in (error.details or {}).items():
                if name in form.fields:
                    form.add_error(name, problem)
            return self._render(scope, form, status=error.status, error=error)
        except (NotFound, PermissionDenied):
            raise
        except BerthError as error:
            return self._render(scope, form, status=error.status, error=error)
        messages.success(request, f"Saved the contract of {scope.written}.")
        return HttpResponseRedirect(scope_url(scope))


# Approvals -----------------------------------------------------------------------------------------

# What each approval policy's subject is, and the scope an approval of it is decided on.
APPROVAL_SUBJECTS = {
    "contract.raise_limit": (Scope.objects.all(), "", lambda scope: scope),
    "credential.create_production": (ServiceClient.objects.select_related("project"), "project",
                                     lambda client: client.project),
}


class AskApprovalView(ConsoleMixin, View):
    http_method_names = ["post"]

    def post(self, request):
        form = AskApprovalForm(request.POST)
        if not form.is_valid():
            return render(request, "tenancy/refused.html",
                          {"error": InvalidInput(first_error(form)), "title": "Cannot ask"}, status=400)
        data = form.cleaned_data
        if data["action"] not in APPROVAL_SUBJECTS:
            raise Http404("No such approval policy.")
        queryset, scope_field, scope_of = APPROVAL_SUBJECTS[data["action"]]
        subject = get_object_or_404(access.visible_to(request.user, queryset, scope_field), public_id=data["subject"])
        try:
            approval = approval_service.request_approval(self.actor, data["action"], scope_of(subject), subject,
                                                         data["evidence"], data["reason"])
        except (NotFound, PermissionDenied):
            raise
        except BerthError as error:
            return render(request, "tenancy/refused.html", {"error": error, "title": "Cannot ask"},
                          status=error.status)
        messages.success(request, "Asked for approval: someone else who may decide on "
                                  f"{approval.scope.written} will see it in their inbox.")
        return HttpResponseRedirect(reverse("tenancy:approvals") + "?tab=mine")


TABS = (("pending", "Pending for me to decide"), ("mine", "Mine, waiting"), ("decided", "Decided"))


class ApprovalsView(ConsolePage):
    """The inbox: what I may decide (not what I asked for), what I asked for, what was decided."""

    model = ApprovalRequest
    queryset = ApprovalRequest.objects.select_related("scope", "requested_by", "decided_by")
    template_name = "tenancy/approvals.html"
    fragment_template_name = "tenancy/approvals_list.html"

    def tabs(self) -> dict[str, list[ApprovalRequest]]:
        user, now, visible = self.request.user, timezone.now(), self.get_queryset()
        pending = visible.filter(status=ApprovalRequest.Status.PENDING, expires_at__gt=now).exclude(requested_by=user)
        return {
            "pending": [a for a in pending if access.can(user, "decide", a)],
            "mine": list(visible.filter(requested_by=user, status__in=[ApprovalRequest.Status.PENDING,
                                                                         ApprovalRequest.Status.APPROVED])),
            "decided": list(visible.exclude(status=ApprovalRequest.Status.PENDING)[:200]),
        }

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        tab = self.request.GET.get("tab") if self.request.GET.get("tab") in dict(TABS) else "pending"
        lists = self.tabs()
        context.update(tab=tab, tabs=[(key, label, len(lists[key])) for key, label in TABS],
                       cards=[approval_card(self.request, a) for a in lists[tab]])
        return context


def approval_card(request, approval: ApprovalRequest, error=None) -> dict:
    user = request.user
    own = approval.requested_by_id == user.pk
    pending = approval.status == ApprovalRequest.Status.PENDING and approval.expires_at > timezone.now()
    carry_out = None
    if own and approval.status == ApprovalRequest.Status.APPROVED:
        if approval.action == "contract.raise_limit":
            carry_out = reverse("tenancy:contract", args=[approval.subject_id]) + f"?approval={approval.public_id}"
        elif approval.action == "credential.create_production":
            carry_out = reverse("tenancy:client", args=[approval.subject_id]) + f"?approval={approval.public_id}"
    return {
        "approval": approval, "own": own, "pending": pending, "error": error, "carry_out": carry_out,
        "may_decide": pending and not own and access.can(user, "decide", approval),
        "evidence": _pretty(approval.evidence),
        "policy": approval_service.POLICIES.get(approval.action),
    }


class ApprovalView(ConsolePage):
    """One request: the page, or (to HTMX) its card alone."""

    model = ApprovalRequest
    queryset = ApprovalRequest.objects.select_related("scope", "requested_by", "decided_by")
    template_name = "tenancy/approval.html"
    fragment_template_name = "tenancy/approval_card.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        approval = self.get_object()
        context["card"] = approval_card(self.request, approval)
        context["breadcrumbs"] = [("Approvals", reverse("tenancy:approvals")),
                                  (f"{approval.action} on {approval.subject_repr}", self.request.path)]
        return context


class DecideView(ObjectAction):
    model = ApprovalRequest
    queryset = ApprovalRequest.objects.select_related("scope", "requested_by", "decided_by")
    form_class = DecideForm

    def perform(self, approval, data):
        decided = approval_service.decide(self.actor, approval, data["decision"] == "approve", data["reason"])
        messages.success(self.request, f"{decided.get_status_display()}: {decided.action} on {decided.subject_repr}.")
        return decided

    def success_url(self, approval, result):
        return reverse("tenancy:approvals")

    def fragment(self, approval, result, error=None):
        list(messages.get_messages(self.request))  # the swapped card shows the outcome
        fresh = self.get_queryset().get(pk=approval.pk)
        return render(self.request, "tenancy/approval_card.html",
                      {"card": approval_card(self.request, fresh, error=error)})


# Audit ---------------------------------------------------------------------------------------------

class AuditMixin:
    """Events keep their scope's path (the scope may be gone since): narrowed by that path, filtered
    by the FilterSet the API's audit endpoints use."""

    model = AuditEvent

    def narrow(self, queryset):
        return access.visible_by_path(self.request.user, queryset, "scope_path")

    def filterset(self):
        return AuditEventFilterSet(self.request.GET, queryset=self.get_queryset(), request=self.request)


class AuditView(AuditMixin, ConsolePage):
    template_name = "tenancy/audit.html"
    fragment_template_name = "tenancy/audit_table.html"
    page_size = 100

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        filterset = self.filterset()
        page = Paginator(filtered(filterset), self.page_size).get_page(self.request.GET.get("page"))
        query = self.request.GET.copy()
        query.pop("page", None)
        context.update(filterset=filterset, page=page, table=AuditTable(page.object_list), query=query.urlencode())
        return context


class AuditExportView(AuditMixin, ConsoleMixin, View):
    """The filtered log as JSON lines, in the API export's schema. A filter it cannot read is refused
    as the API refuses it (a scope outside reach: 404, as one that does not exist)."""

    def get(self, request):
        filterset = self.filterset()
        if not filterset.is_valid():
            raise InvalidInput(first_error(filterset.form), details=filterset.form.errors.get_json_data())
        return audit_export(filterset.qs)
