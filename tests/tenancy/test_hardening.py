"""What a security review of tenancy found, each pinned by a test: management clients that climbed
above their maker, keys that skipped the production approval, contracts loosened without one, an
organisation left without an owner, approvals answered before permission, server errors on odd input,
written scopes that did not resolve as documented, and a limit chain that showed too much."""

import importlib
import threading
from decimal import Decimal

import pytest
from django.apps import apps
from django.db import connection, transaction

from berth.errors import NotFound
from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.errors import ApiKeyRevoked, ApprovalRequired, Forbidden, LastOwner
from tenancy.models import AuditEvent, Contract, Credential, Membership, Role, Scope, ServiceClient
from tenancy.services import approvals, clients, contracts, members, tree
from tests.assets.waiting import wait_until

pytestmark = pytest.mark.django_db

CLIENTS = "/api/tenancy/clients/"
KEYS = "/api/tenancy/credentials/"
SCOPES = "/api/tenancy/scopes/"
CONTRACTS = "/api/tenancy/contracts/"
APPROVALS = "/api/tenancy/approvals/"


def bearer(key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def error_code(response) -> str:
    return response.json()["error"]["code"]


def approved(asker, decider, action, scope, subject, evidence):
    approval = approvals.request_approval(asker, action, scope, subject, evidence, "the test needs it")
    return approvals.decide(decider, approval, True)


def blocked_on_a_lock(pid: int) -> bool:
    """Whether the database session ``pid`` waits for a lock another session holds (pg_locks is live,
    unlike pg_stat_activity, which a transaction sees as a snapshot)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", [pid])
        return cursor.fetchone()[0]


class InThread:
    """Run ``work`` on its own database connection; ``pid`` is that connection's backend."""

    def __init__(self, work):
        self.work, self.result, self.error, self.pid = work, None, None, None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.started.wait(30)

    def _run(self):
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid = cursor.fetchone()[0]
            self.started.set()
            self.result = self.work()
        except Exception as error:  # noqa: BLE001 - handed to the test to assert on
            self.error = error
        finally:
            self.started.set()
            connection.close()

    def join(self):
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self


# --- 1. a management client never acts above whoever gave it management access -------------------

@pytest.mark.parametrize("kind", ["management", "both"])
def test_member_cannot_create_a_management_client_and_an_admin_can(personas, api, kind):
    with pytest.raises(Forbidden):
        clients.create_client(personas.max_actor, personas.acme.project, "escalator", access=kind)
    refused = api(personas.max).post(CLIENTS, {"project": "project:acme/ml/search", "name": "escalator",
                                               "access": kind})
    assert (refused.status_code, error_code(refused)) == (403, "permission_denied")
    assert not ServiceClient.objects.filter(name="escalator").exists()
    made = api(personas.olivia).post(CLIENTS, {"project": "project:acme/ml/search", "name": "robot", "access": kind})
    assert made.status_code == 201, made.content
    assert made.json()["granted_by"] == "olivia"
    assert ServiceClient.objects.get(name="robot").granted_by == personas.olivia


def test_member_cannot_patch_a_client_to_management_and_an_admin_can(personas, api):
    client = clients.create_client(personas.max_actor, personas.acme.project, "app")
    url = f"{CLIENTS}{client.public_id}/"
    refused = api(personas.max).patch(url, {"access": "management"})
    assert (refused.status_code, error_code(refused)) == (403, "permission_denied")
    with pytest.raises(Forbidden):
        clients.update_client(personas.max_actor, client, access="both")
    client.refresh_from_db()
    assert client.access == "inference" and client.granted_by is None
    assert api(personas.olivia).patch(url, {"access": "management"}).status_code == 200
    client.refresh_from_db()
    assert client.access == "management" and client.granted_by == personas.olivia


def test_member_cannot_mint_or_rotate_a_key_of_a_management_client(personas, api, management_key):
    robot = management_key()
    max_ = api(personas.max)
    minted = max_.post(KEYS, {"client": str(robot.client.public_id)})
    assert (minted.status_code, error_code(minted)) == (403, "permission_denied")
    rotated = max_.post(f"{KEYS}{robot.credential.public_id}/rotate/", {"overlap_hours": 1})
    assert (rotated.status_code, error_code(rotated)) == (403, "permission_denied")
    assert robot.client.credentials.count() == 1
    # Taking power away stays a member's right.
    assert max_.post(f"{KEYS}{robot.credential.public_id}/revoke/").status_code == 200


def test_a_management_key_loses_what_its_granter_loses(personas, api, otto):
    """otto (admin of acme) gives a client management access; demoted to member, so is the client;
    removed, the client reaches nothing."""
    client = clients.create_client(Actor(user=otto), personas.acme.project, "otto-bot", access="management")
    _, key = clients.create_credential(Actor(user=otto), client)
    rename = f"{SCOPES}{personas.acme.project.public_id}/"
    assert api().patch(rename, {"name": "Search 2"}, **bearer(key)).status_code == 200
    membership = Membership.objects.get(user=otto)
    members.change_role(personas.olivia_actor, membership, Role.MEMBER)
    demoted = api().patch(rename, {"name": "Search 3"}, **bearer(key))
    assert (demoted.status_code, error_code(demoted)) == (403, "permission_denied")
    assert api().get(rename, **bearer(key)).status_code == 200  # a member still sees its project
    members.remove_member(personas.olivia_actor, membership)
    assert api().get(rename, **bearer(key)).status_code == 404


def test_a_management_client_makes_clients_no_stronger_than_its_granter(personas, management_key):
    robot = management_key()  # olivia's, an admin of acme/ml/search through it
    child = clients.create_client(Actor(client=robot.client), personas.acme.project, "child", access="management")
    assert child.granted_by == personas.olivia


def test_existing_management_clients_get_their_granter_from_the_audit_log(personas):
    """The migration: a client a member made before the fix acts as that member from then on."""
    made = ServiceClient.objects.create(project=personas.acme.project, name="old-bot", access="management")
    audit.record(personas.max_actor, "client.create", made, details={"name": "old-bot", "access": "management"})
    by_berth = ServiceClient.objects.create(project=personas.acme.project, name="cli-bot", access="management")
    audit.record(Actor(system="cli"), "client.create", by_berth, details={"name": "cli-bot", "access": "management"})
    upgraded = ServiceClient.objects.create(project=personas.acme.project, name="upgraded", access="management")
    audit.record(personas.max_actor, "client.create", upgraded, details={"name": "upgraded"})
    audit.record(personas.olivia_actor, "client.update", upgraded,
                 details={"before": {"access": "inference"}, "after": {"access": "management"}})
    migration = importlib.import_module("tenancy.migrations.0003_client_granted_by")
    migration.granted_by_from_the_audit_log(apps, None)
    granted = dict(ServiceClient.objects.values_list("name", "granted_by"))
    assert granted == {"old-bot": personas.max.pk, "cli-bot": None, "upgraded": personas.olivia.pk}
    assert access.roles(ServiceClient.objects.get(name="old-bot")) == {"acme/ml/search": Role.MEMBER}


# --- 2. moving a client into production revokes the keys minted without its approval --------------

def test_moving_a_client_into_production_revokes_its_keys(personas, api, monkeypatch):
    published = []
    monkeypatch.setattr("tenancy.events.credentials_changed", published.extend)  # what the gateways are told
    client = clients.create_client(personas.max_actor, personas.acme.project, "app", all_models=True)
    first, _ = clients.create_credential(personas.max_actor, client, name="a")
    second, _ = clients.create_credential(personas.max_actor, client, name="b")
    moved = api(personas.max).patch(f"{CLIENTS}{client.public_id}/", {"environment": "production"})
    assert moved.status_code == 200 and moved.json()["environment"] == "production"
    assert Credential.objects.filter(client=client, revoked_at__isnull=True).count() == 0
    assert sorted(published) == sorted([first.lookup, second.lookup])
    update = AuditEvent.objects.get(action="client.update")
    assert sorted(update.details["revoked"]) == sorted([first.prefix, second.prefix])
    revocations = AuditEvent.objects.filter(action="credential.revoke")
    assert sorted(e.details["prefix"] for e in revocations) == sorted([first.prefix, second.prefix])
    assert all("production" in e.details["reason"] for e in revocations)
    # A new key needs the production approval, as any production key does.
    again = api(personas.max).post(KEYS, {"client": str(client.public_id)})
    assert (again.status_code, error_code(again)) == (428, "approval_required")


def test_giving_a_client_management_access_revokes_the_keys_a_member_minted_for_inference(personas, api):
    client = clients.create_client(personas.max_actor, personas.acme.project, "app", all_models=True)
    _, plaintext = clients.create_credential(personas.max_actor, client, name="max's")
    upgraded = api(personas.olivia).patch(f"{CLIENTS}{client.public_id}/", {"access": "both"})
    assert upgraded.status_code == 200 and upgraded.json()["access"] == "both"
    with pytest.raises(ApiKeyRevoked):
        clients.authenticate(plaintext)  # max's key would now act as an admin of the project
    revocation = AuditEvent.objects.get(action="credential.revoke")
    assert "management access" in revocation.details["reason"]
    # A key the admin mints now is the client's management key.
    _, fresh = clients.create_credential(personas.olivia_actor, client, name="olivia's")
    assert clients.authenticate(fresh).client.may_manage


def test_staying_in_production_revokes_nothing(personas, management_key):
    robot = management_key(environment="production")
    clients.update_client(personas.olivia_actor, robot.client, environment="production", description="same place")
    robot.credential.refresh_from_db()
    assert robot.credential.revoked_at is None


@pytest.mark.django_db(transaction=True)
def test_a_key_minted_while_the_client_moves_into_production_waits_and_then_needs_an_approval(personas):
    client = clients.create_client(personas.max_actor, personas.acme.project, "app")
    with transaction.atomic():
        clients.update_client(personas.max_actor, client, environment="production")  # its lock held until commit
        minting = InThread(lambda: clients.create_credential(personas.max_actor,
                                                             ServiceClient.objects.get(pk=client.pk)))
        wait_until(lambda: blocked_on_a_lock(minting.pid), 10, what="the mint waiting for the client's lock")
    minting.join()
    assert isinstance(minting.error, ApprovalRequired)
    assert not Credential.objects.filter(client=client).exists()


# --- 3. loosening a contract takes an approval, whichever figure loosens it ------------------------

def test_softening_a_hard_budget_needs_an_approval(personas, api, ada):
    url = f"{CONTRACTS}{personas.acme.org.public_id}/"
    olivia = api(personas.olivia)
    assert olivia.patch(url, {"daily_token_budget": 1000}).status_code == 200  # a first budget lowers
    refused = olivia.patch(url, {"budget_mode": "soft"})
    assert (refused.status_code, error_code(refused)) == (428, "approval_required")
    assert Contract.objects.get(scope=personas.acme.org).budget_mode == "hard"
    evidence = refused.json()["error"]["details"]["evidence"]
    approval = approved(personas.olivia_actor, Actor(user=ada), "contract.raise_limit", personas.acme.org,
                        personas.acme.org, evidence)
    done = olivia.patch(url, {"budget_mode": "soft", "approval": str(approval.public_id)})
    assert done.status_code == 200 and done.json()["budget_mode"] == "soft"


def test_soft_mode_without_any_budget_softens_nothing_and_needs_no_approval(personas):
    contract = contracts.set_contract(personas.olivia_actor, personas.acme.team, budget_mode="soft", rpm_limit=10)
    assert contract.budget_mode == "soft"
    # A budget added later is a new limit (it only warns, where there was nothing): no approval either.
    assert contracts.set_contract(personas.olivia_actor, personas.acme.team, daily_token_budget=5).daily_token_budget == 5


def test_setting_or_raising_a_guarantee_needs_an_approval_and_lowering_one_does_not(personas, ada):
    olivia = personas.olivia_actor
    with pytest.raises(ApprovalRequired) as needed:
        contracts.set_contract(olivia, personas.acme.org, gpus_guarantee=4)
    assert needed.value.details["evidence"]["proposed"]["gpus_guarantee"] == "4"
    approval = approved(olivia, Actor(user=ada), "contract.raise_limit", personas.acme.org, personas.acme.org,
                        needed.value.details["evidence"])
    contracts.set_contract(olivia, personas.acme.org, gpus_guarantee=4, approval=approval)
    with pytest.raises(ApprovalRequired):
        contracts.set_contract(olivia, personas.acme.org, gpus_guarantee=6)
    assert contracts.set_contract(olivia, personas.acme.org, gpus_guarantee=2).gpus_guarantee == Decimal(2)
    assert contracts.set_contract(olivia, personas.acme.org, gpus_guarantee=None).gpus_guarantee is None


# --- 4. an organisation keeps an owner -------------------------------------------------------------

def test_the_last_owner_cannot_remove_or_demote_their_own_membership(personas, api, otto):
    membership = Membership.objects.get(user=personas.olivia, scope=personas.acme.org)
    url = f"/api/tenancy/memberships/{membership.public_id}/"
    olivia = api(personas.olivia)
    for response in (olivia.delete(url), olivia.patch(url, {"role": "admin"})):
        assert (response.status_code, error_code(response)) == (409, "last_owner")
    with pytest.raises(LastOwner):
        members.remove_member(Actor(system="tests"), membership)  # not even Berth itself
    assert Membership.objects.get(pk=membership.pk).role == Role.OWNER
    # With a second owner, either may step down.
    members.change_role(personas.olivia_actor, Membership.objects.get(user=otto), Role.OWNER)
    assert olivia.patch(url, {"role": "admin"}).status_code == 200
    assert Membership.objects.filter(scope=personas.acme.org, role=Role.OWNER).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_owners_leaving_at_once_leave_one_behind(personas, otto):
    members.change_role(personas.olivia_actor, Membership.objects.get(user=otto), Role.OWNER)
    olivias = Membership.objects.get(user=personas.olivia, scope=personas.acme.org)
    ottos = Membership.objects.get(user=otto, scope=personas.acme.org)
    with transaction.atomic():
        members.remove_member(personas.olivia_actor, olivias)  # holds the owners' locks until commit
        leaving = InThread(lambda: members.remove_member(Actor(user=otto), ottos))
        wait_until(lambda: blocked_on_a_lock(leaving.pid), 10, what="otto's removal waiting for the owners' lock")
    leaving.join()
    assert isinstance(leaving.error, LastOwner)
    assert list(Membership.objects.filter(scope=personas.acme.org, role=Role.OWNER).values_list("user__username",
                                                                                                 flat=True)) == ["otto"]


# --- 5. who may ask comes before anything about the evidence ---------------------------------------

def test_a_viewer_asking_for_an_approval_gets_403_whatever_the_evidence(personas, api):
    vera = api(personas.vera)
    contracts.set_contract(personas.olivia_actor, personas.acme.project, gpus_limit=2)
    asks = [
        {"action": "contract.raise_limit", "reason": "x", "scope": "project:acme/ml/search",
         "proposed": {"gpus_limit": 8}, "fingerprint": "0" * 64},                          # stale fingerprint
        {"action": "contract.raise_limit", "reason": "x", "scope": "project:acme/ml/search",
         "proposed": {"gpus_limit": 1}},                                                    # raises nothing
        {"action": "credential.create_production", "reason": "x",
         "subject": str(clients.create_client(personas.max_actor, personas.acme.project, "dev").public_id)},
    ]
    for body in asks:
        response = vera.post(APPROVALS, body)
        assert (response.status_code, error_code(response)) == (403, "permission_denied"), (body, response.content)
    # A member still hears about the fingerprint.
    stale = api(personas.max).post(APPROVALS, asks[0])
    assert (stale.status_code, error_code(stale)) == (409, "approval_stale")


# --- 6. odd input is a clear answer, never a server error ------------------------------------------

LISTS = [SCOPES, "/api/tenancy/memberships/", CLIENTS, KEYS, CONTRACTS, APPROVALS, "/api/tenancy/audit/"]


@pytest.mark.parametrize("url", LISTS)
def test_a_limit_beyond_any_page_is_clamped(personas, api, management_key, url):
    management_key()
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=8)
    approvals.request_approval(personas.olivia_actor, "contract.raise_limit", personas.acme.org, personas.acme.org,
                               contracts.raise_limit_evidence(personas.acme.org, gpus_limit=16), "more")
    olivia = api(personas.olivia)
    for limit in (2 ** 63, 2 ** 64, 10 ** 30):
        response = olivia.get(url, {"limit": limit})
        assert response.status_code == 200, (limit, response.content)
        assert 0 < len(response.json()["results"]) <= 1000
    assert olivia.get(url, {"limit": 2 ** 63, "offset": 2 ** 63}).json()["results"] == []


def test_every_api_list_pages_with_the_clamping_paginator():
    """Other apps' lists share the class, so the clamp covers them too."""
    from django.urls import get_resolver
    from rest_framework.settings import api_settings

    from berth.api import Pagination

    assert api_settings.DEFAULT_PAGINATION_CLASS is Pagination

    def views(patterns):
        for pattern in patterns:
            if hasattr(pattern, "url_patterns"):
                yield from views(pattern.url_patterns)
            else:
                yield getattr(pattern.callback, "cls", None)

    paginated = {cls for cls in views(get_resolver().url_patterns) if getattr(cls, "pagination_class", None)}
    assert paginated, "no paginated API view found"
    assert {cls.__name__ for cls in paginated if not issubclass(cls.pagination_class, Pagination)} == set()


@pytest.mark.parametrize("path", ["contracts/not-a-uuid/", "contracts/1/", "scopes/nope/", "clients/0/",
                                  "credentials/brk_x/", "memberships/x/", "approvals/x/approve/", "audit/1/"])
def test_an_id_that_is_no_uuid_is_a_404(personas, api, path):
    response = api(personas.olivia).get(f"/api/tenancy/{path}", HTTP_ACCEPT="application/json")
    assert (response.status_code, error_code(response)) == (404, "not_found")


def test_an_unknown_uuid_on_contracts_is_still_a_404(personas, api):
    response = api(personas.olivia).get(f"{CONTRACTS}00000000-0000-0000-0000-000000000000/")
    assert (response.status_code, error_code(response)) == (404, "scope_not_found")


# --- 7. a unique last element resolves, as the README says -----------------------------------------

def test_a_scope_resolves_by_its_unique_last_element_without_a_kind(personas, api, admin_user):
    tree.create_scope(personas.olivia_actor, "project", "app2", parent=personas.acme.team)
    tree.create_scope(personas.olivia_actor, "team", "data", parent=personas.acme.org)
    tree.create_scope(personas.olivia_actor, "project", "search",
                      parent=Scope.objects.get(path="acme/data"))
    resolve = SCOPES + "resolve/"
    found = api(personas.max).get(resolve, {"scope": "app2"})
    assert found.status_code == 200, found.content
    assert found.json()["path"] == "acme/ml/app2"
    assert api(personas.max).get(resolve, {"scope": "acme/ml"}).json()["path"] == "acme/ml"  # a full path
    assert api(personas.vera).get(resolve, {"scope": "search"}).json()["path"] == "acme/ml/search"
    # olivia sees two projects called search (not globex's): the candidates are those two.
    ambiguous = api(personas.olivia).get(resolve, {"scope": "search"})
    assert (ambiguous.status_code, error_code(ambiguous)) == (400, "ambiguous_scope")
    assert ambiguous.json()["error"]["details"]["candidates"] == ["project:acme/data/search",
                                                                  "project:acme/ml/search"]
    assert "globex" not in ambiguous.content.decode()
    unknown = api(personas.olivia).get(resolve, {"scope": "nowhere"})
    assert (unknown.status_code, error_code(unknown)) == (404, "scope_not_found")
    hidden = api(personas.vera).get(resolve, {"scope": "app2"})  # exists, but not for vera
    assert (hidden.status_code, error_code(hidden)) == (404, "scope_not_found")
    assert api(admin_user).get(resolve, {"scope": "search"}).json()["error"]["details"]["candidates"] == [
        "project:acme/data/search", "project:acme/ml/search", "project:globex/ml/search"]


# --- 8. the limit chain shows what a direct read would ---------------------------------------------

def test_the_chain_shows_only_contracts_of_scopes_the_caller_may_view(personas, api):
    for scope, limit in ((personas.acme.org, 16), (personas.acme.team, 8), (personas.acme.project, 4)):
        contracts.set_contract(personas.olivia_actor, scope, gpus_limit=limit)

    def chain(user):
        response = api(user).get(CONTRACTS + "chain/", {"scope": "project:acme/ml/search"})
        assert response.status_code == 200, response.content
        return [row["scope_written"] for row in response.json()]

    assert chain(personas.olivia) == ["project:acme/ml/search", "team:acme/ml", "org:acme"]
    assert chain(personas.max) == ["project:acme/ml/search", "team:acme/ml"]
    assert chain(personas.vera) == ["project:acme/ml/search"]
    # ... as the direct reads answer.
    assert api(personas.max).get(f"{CONTRACTS}{personas.acme.org.public_id}/").status_code == 404
    assert api(personas.vera).get(f"{CONTRACTS}{personas.acme.team.public_id}/").status_code == 404
    with pytest.raises(NotFound):
        access.require(personas.vera, "view", personas.acme.team)
