"""Node trust, its identity half: one-time expiring enrolment tokens, each node's own credential (only its
hash kept), revocation that holds from the next request, and a credential that opens the node API only."""

from __future__ import annotations

import asyncio
import json
import stat
import threading
from datetime import timedelta
from io import StringIO

import httpx
import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory
from rest_framework.views import APIView

from scheduler import enrolment, reach
from scheduler.api.node_auth import IsNode, NodeAuthentication, NodePrincipal, refuse_foreign
from scheduler.errors import (
    EnrolmentTokenSpent,
    InvalidEnrolmentRequest,
    NodeNameTaken,
    NodeOwnershipMismatch,
    NodeTrustForStaff,
)
from scheduler.models import EnrolmentToken, Node
from scheduler.services import NodeReport, register_node
from tenancy import audit
from tenancy.models import AuditEvent
from tenancy.services import clients

pytestmark = pytest.mark.django_db

ENROL = "/api/node/enrol/"
TOKENS = "/api/scheduler/enrolment-tokens/"
BERTH = audit.Actor(system="test")


@pytest.fixture
def staff(django_user_model):
    """A fleet operator: staff, not a superuser."""
    return django_user_model.objects.create_user("stella", "stella@example.org", "a-long-test-password",
                                                 is_staff=True)


def api(user=None, credential=None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_login(user)
    if credential is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {credential}")
    return client


def enrol(token, name="gpu-07", address="127.0.0.1"):
    return APIClient().post(ENROL, {"token": token, "name": name, "address": address}, format="json")


def code_of(response) -> str:
    return response.json()["error"]["code"]


class Whoami(APIView):
    """A node API view, as the node API's are: only a node's credential, only for nodes."""

    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]

    def get(self, request):
        return Response({"node": request.auth.name, "principal": str(request.user)})


def whoami(authorization: str | None = None, user=None):
    request = APIRequestFactory().get("/api/node/whoami/", **({"HTTP_AUTHORIZATION": authorization}
                                                               if authorization else {}))
    if user is not None:
        request.user = user
    response = Whoami.as_view()(request)
    response.render()
    return response


# --- tokens: once, and not after they expire --------------------------------------------------------

def test_a_token_enrols_a_new_node_once_and_its_credential_is_the_nodes(staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff), ttl_seconds=600)
    assert token.startswith("bne_")

    first = enrol(token, name="gpu-07", address="127.0.0.7")
    assert first.status_code == 201, first.content
    body = first.json()
    node = Node.objects.get(name="gpu-07")
    assert body["node"] == {"id": str(node.public_id), "name": "gpu-07"} and node.address == "127.0.0.7"
    assert body["credential"].startswith("bnc_") and enrolment.authenticate(body["credential"]) == node
    assert node.credential_state == "active" and bytes(node.credential_digest) != body["credential"].encode()
    row = EnrolmentToken.objects.get()
    assert row.used_at is not None and row.used_by_node == node and row.state() == "used"

    again = enrol(token, name="gpu-08")
    assert again.status_code == 401 and code_of(again) == "enrolment_token_spent"
    assert not Node.objects.filter(name="gpu-08").exists()
    assert whoami(f"Bearer {body['credential']}").data["node"] == "gpu-07"


def test_a_token_expires(staff, monkeypatch):
    row, token = enrolment.issue_token(audit.Actor(user=staff), ttl_seconds=60)
    later = row.expires_at + timedelta(seconds=1)
    monkeypatch.setattr(timezone, "now", lambda: later)  # time travel, not a sleep
    answer = enrol(token)
    assert answer.status_code == 401 and code_of(answer) == "enrolment_token_expired"
    row.refresh_from_db()
    assert row.used_at is None and row.state() == "expired" and not Node.objects.exists()


def test_a_token_just_before_its_expiry_still_works(staff, monkeypatch):
    row, token = enrolment.issue_token(audit.Actor(user=staff), ttl_seconds=60)
    earlier = row.expires_at - timedelta(seconds=1)
    monkeypatch.setattr(timezone, "now", lambda: earlier)
    assert enrol(token).status_code == 201


def test_a_token_nobody_issued_is_refused_alike_malformed_or_wrong(staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff))
    lookup = token.split("_")[1]
    for written in ("nonsense", "bne_short", f"bne_{lookup}_{'A' * 43}", "bne_0123456789ab_" + "A" * 43,
                    token.replace("bne_", "bnc_")):
        answer = enrol(written)
        assert answer.status_code == 401 and code_of(answer) == "enrolment_token_invalid", written
    assert EnrolmentToken.objects.get().used_at is None  # the real one is still unspent
    assert enrol(token).status_code == 201


def test_two_agents_racing_with_one_token_get_one_credential(transactional_db, staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff))
    barrier, results = threading.Barrier(2), []

    def spend(name):
        barrier.wait()
        try:
            enrolment.enrol(token, name=name, address="127.0.0.1")
            results.append("enrolled")
        except EnrolmentTokenSpent:
            results.append("spent")
        except Exception as error:  # noqa: BLE001 - said in the assertion below
            results.append(repr(error))
        finally:
            connection.close()

    threads = [threading.Thread(target=spend, args=(f"racer-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(results) == ["enrolled", "spent"]
    assert Node.objects.count() == 1 and AuditEvent.objects.filter(action="node.enrol").count() == 1


def test_a_bad_name_or_address_is_an_invalid_node_report_and_spends_nothing(staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff))
    for name, address in (("has space", "127.0.0.1"), ("-dash-first", "127.0.0.1"), ("", "127.0.0.1"),
                          ("gpu-07", ""), ("gpu-07", "http://x/ y")):
        answer = enrol(token, name=name, address=address)
        assert answer.status_code == 400 and code_of(answer) == "invalid_node_report", (name, address)
    assert EnrolmentToken.objects.get().used_at is None and not Node.objects.exists()


def test_a_token_that_names_the_node_decides_its_name(staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff), name="gpu-09")
    answer = enrol(token, name="what-the-agent-says")
    assert answer.status_code == 201 and answer.json()["node"]["name"] == "gpu-09"


def test_expiry_out_of_bounds_is_refused(staff):
    for seconds in (0, 59, 7 * 86400 + 1):
        with pytest.raises(InvalidEnrolmentRequest):
            enrolment.issue_token(audit.Actor(user=staff), ttl_seconds=seconds)
    answer = api(staff).post(TOKENS, {"expires_minutes": 0}, format="json")
    assert answer.status_code == 400


# --- existing nodes, and names that are taken -------------------------------------------------------

def test_an_existing_token_gives_a_registered_node_its_credential(cpu_node, staff):
    assert cpu_node.credential_state == "none"  # registered before enrolment existed
    _, token = enrolment.issue_token(audit.Actor(user=staff), existing="cpu-01")
    answer = enrol(token, name="", address="")
    assert answer.status_code == 201, answer.content
    assert answer.json()["node"] == {"id": str(cpu_node.public_id), "name": "cpu-01"}
    cpu_node.refresh_from_db()
    assert cpu_node.address == "127.0.0.1" and cpu_node.engines.count() == 1  # the same row, kept as it was
    assert enrolment.authenticate(answer.json()["credential"]) == cpu_node
    assert Node.objects.count() == 1


def test_another_token_cannot_take_the_name_of_an_enrolled_node(cpu_node, staff):
    actor = audit.Actor(user=staff)
    _, first = enrolment.issue_token(actor, existing=cpu_node)
    credential = enrol(first).json()["credential"]

    with pytest.raises(NodeNameTaken):  # said when it is asked for
        enrolment.issue_token(actor, name="cpu-01")
    _, anonymous = enrolment.issue_token(actor)  # the agent names itself: refused when it tries
    answer = enrol(anonymous, name="cpu-01", address="127.0.0.9")
    assert answer.status_code == 409 and code_of(answer) == "node_name_taken"
    assert EnrolmentToken.objects.get(lookup=anonymous.split("_")[1]).used_at is None
    cpu_node.refresh_from_db()
    assert cpu_node.address == "127.0.0.1" and enrolment.authenticate(credential) == cpu_node

    _, again = enrolment.issue_token(actor, existing="cpu-01")  # the node's own: rotates its credential
    fresh = enrol(again).json()["credential"]
    assert enrolment.authenticate(fresh) == cpu_node and enrolment.authenticate(credential) is None


def test_a_plain_token_may_name_a_node_from_before_enrolment(cpu_node, staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff), name="cpu-01")
    answer = enrol(token, address="127.0.0.11")
    assert answer.status_code == 201 and answer.json()["node"]["id"] == str(cpu_node.public_id)


# --- revocation -------------------------------------------------------------------------------------

def test_revoking_refuses_the_credential_at_once_and_a_token_for_the_node_lets_it_back(staff):
    actor = audit.Actor(user=staff)
    _, token = enrolment.issue_token(actor)
    credential = enrol(token).json()["credential"]
    node = Node.objects.get(name="gpu-07")
    assert whoami(f"Bearer {credential}").status_code == 200

    revoked = api(staff).post(f"/api/scheduler/nodes/{node.public_id}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["credential_state"] == "revoked"
    assert enrolment.authenticate(credential) is None and enrolment.identify(credential) == node
    refused = whoami(f"Bearer {credential}")
    assert refused.status_code == 401 and refused.data["error"]["code"] == "node_revoked"
    assert Node.objects.filter(pk=node.pk).exists()  # the row stays, shown revoked
    enrolment.revoke(actor, node)  # twice is harmless
    assert AuditEvent.objects.filter(action="node.revoke").count() == 1

    _, plain = enrolment.issue_token(actor)  # a revoked node's name is still taken
    assert code_of(enrol(plain, name="gpu-07")) == "node_name_taken"
    _, back = enrolment.issue_token(actor, existing=node)
    fresh = enrol(back).json()["credential"]
    assert whoami(f"Bearer {fresh}").status_code == 200
    assert whoami(f"Bearer {credential}").data["error"]["code"] == "node_credential_invalid"


def test_the_node_api_takes_nothing_but_a_node_credential(personas, admin_user):
    key = make_management_key(personas)
    for authorization in (None, f"Bearer {key}", "Bearer bnc_0123456789ab_" + "x" * 43, "Basic Zm9vOmJhcg=="):
        answer = whoami(authorization)
        assert answer.status_code == 401, (authorization, answer.data)
    assert whoami("Bearer bnc_0123456789ab_" + "x" * 43).data["error"]["code"] == "node_credential_invalid"
    assert whoami(user=admin_user).status_code == 401  # not even a superuser: the node API is for nodes


def make_management_key(personas) -> str:
    client = clients.create_client(personas.olivia_actor, personas.acme.project, "ops", access="both")
    return clients.create_credential(personas.olivia_actor, client, name="ops")[1]


def test_a_node_credential_gets_nothing_on_the_management_api_nor_the_gateway(staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff))
    credential = enrol(token).json()["credential"]
    node = api(credential=credential)
    for path in ("/api/scheduler/nodes/", TOKENS, "/api/tenancy/scopes/", "/api/serving/deployments/"):
        answer = node.get(path)
        assert answer.status_code in (401, 403), (path, answer.status_code)
    assert node.post(TOKENS, {}, format="json").status_code in (401, 403)
    assert not EnrolmentToken.objects.filter(used_at__isnull=True).exists()

    from berth.asgi import application

    async def models():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as gateway:
            return await gateway.get("/v1/models", headers={"Authorization": f"Bearer {credential}"})

    answer = asyncio.run(models())
    assert answer.status_code == 401, answer.text


def test_the_principal_of_a_node_is_nobodys_member(staff):
    _, token = enrolment.issue_token(audit.Actor(user=staff))
    credential = enrol(token).json()["credential"]
    principal, node = NodeAuthentication().authenticate(APIRequestFactory().get(
        "/", HTTP_AUTHORIZATION=f"Bearer {credential}"))
    assert isinstance(principal, NodePrincipal) and principal.node == node
    assert principal.is_authenticated and not principal.is_staff and not principal.is_superuser
    assert principal.actor.written == "node:gpu-07"
    assert not reach.sees_everything(principal) and not reach.sees_everything(principal.actor)


# --- who may issue and revoke -----------------------------------------------------------------------

def test_only_operators_issue_tokens_and_revoke(personas, cpu_node, staff):
    for person in (personas.vera, personas.max, personas.olivia, personas.oscar):
        client = api(person)
        assert client.post(TOKENS, {"name": "x-1"}, format="json").status_code == 403, person
        assert client.get(TOKENS).status_code == 403
        assert client.post(f"/api/scheduler/nodes/{cpu_node.public_id}/revoke/").status_code == 403
    for actor in (personas.oscar_actor, personas.olivia_actor, enrolment.NodeActor(node="cpu-01")):
        with pytest.raises(NodeTrustForStaff) as refused:
            enrolment.issue_token(actor)
        assert refused.value.status == 403
        with pytest.raises(NodeTrustForStaff):
            enrolment.revoke(actor, cpu_node)
        with pytest.raises(NodeTrustForStaff):
            enrolment.issue_credential(actor, cpu_node)
    assert not EnrolmentToken.objects.exists()
    cpu_node.refresh_from_db()
    assert cpu_node.revoked_at is None and cpu_node.credential_lookup is None
    assert not AuditEvent.objects.exists()
    assert api(staff).post(TOKENS, {"name": "x-1"}, format="json").status_code == 201


def test_secrets_are_said_once_and_never_kept_nor_listed(staff, admin_user):
    created = api(staff).post(TOKENS, {"name": "gpu-07", "expires_minutes": 30}, format="json")
    assert created.status_code == 201, created.content
    token = created.json()["token"]
    assert created.json()["state"] == "pending" and created.json()["prefix"] == token[:len("bne_") + 13]
    credential = enrol(token).json()["credential"]
    _, second = enrolment.issue_token(audit.Actor(user=staff), existing="gpu-07")
    rotated = enrolment.issue_credential(BERTH, "gpu-07")

    secrets = (token, token.split("_", 2)[2], credential, credential.split("_", 2)[2], second, rotated)
    node = Node.objects.get(name="gpu-07")
    admin = api(admin_user)
    listed = [admin.get(TOKENS).content.decode(), admin.get("/api/scheduler/nodes/").content.decode(),
              admin.get(f"/api/scheduler/nodes/{node.public_id}/").content.decode(),
              admin.get("/api/tenancy/audit/").content.decode()]
    assert "gpu-07" in listed[0] and "node.enrol" in listed[3]
    events = list(AuditEvent.objects.values_list("action", "details", "object_repr"))
    assert {e[0] for e in events} == {"node.enrolment_token.issue", "node.enrol", "node.credential.issue"}
    kept = json.dumps(events) + "".join(listed)
    for secret in secrets:
        assert secret not in kept
    enrol_event = AuditEvent.objects.get(action="node.enrol")
    assert enrol_event.actor == "node:gpu-07" and enrol_event.object_id == str(node.public_id)


def test_an_unused_token_can_be_withdrawn_and_a_used_one_not(staff):
    client = api(staff)
    unused = client.post(TOKENS, {}, format="json").json()
    assert client.delete(f"{TOKENS}{unused['id']}/").status_code == 204
    assert enrol(unused["token"]).status_code == 401
    used = client.post(TOKENS, {}, format="json").json()
    assert enrol(used["token"]).status_code == 201
    answer = client.delete(f"{TOKENS}{used['id']}/")
    assert answer.status_code == 409 and code_of(answer) == "enrolment_token_used"
    assert [e.action for e in AuditEvent.objects.order_by("id")].count("node.enrolment_token.withdraw") == 1


# --- a node touching another's ----------------------------------------------------------------------

def test_refuse_foreign_audits_and_refuses(cpu_node):
    other = register_node(NodeReport(name="cpu-02", address="127.0.0.2"))
    engine = cpu_node.engines.get()
    with pytest.raises(NodeOwnershipMismatch) as refused:
        refuse_foreign(other, "report on engine", engine)
    assert refused.value.status == 403 and refused.value.code == "node_ownership_mismatch"
    event = AuditEvent.objects.get(action="node.ownership_mismatch")
    assert event.actor == "node:cpu-02" and event.actor_user is None and event.actor_client is None
    assert event.details == {"node": "cpu-02", "node_id": str(other.public_id), "what": "report on engine",
                             "object": str(engine.pk)}
    assert event.object_type == "scheduler.nodeengine"


# --- manage.py nodes --------------------------------------------------------------------------------

def run(*args) -> str:
    out = StringIO()
    call_command("nodes", *args, stdout=out)
    return out.getvalue()


def test_nodes_enrol_prints_a_token_and_the_agents_command_line(settings):
    settings.SERVING_CONTROL_URL = "https://berth.example"
    printed = run("enrol", "--name", "gpu-11", "--expires-minutes", "5")
    token = next(line for line in printed.splitlines() if line.startswith("bne_"))
    assert f"manage.py agent --server https://berth.example --token {token}" in printed
    row = EnrolmentToken.objects.get()
    assert row.name == "gpu-11" and row.created_by == "system:nodes"
    assert timedelta(minutes=4) < row.expires_at - timezone.now() <= timedelta(minutes=5)
    assert enrol(token).json()["node"]["name"] == "gpu-11"


def test_nodes_enrol_existing_and_credential_write_and_revoke_and_list(cpu_node, tmp_path):
    printed = run("enrol", "--existing", "cpu-01", "--server", "http://127.0.0.1:8000/")
    token = next(line for line in printed.splitlines() if line.startswith("bne_"))
    assert "--server http://127.0.0.1:8000 --token" in printed
    assert enrol(token).json()["node"]["id"] == str(cpu_node.public_id)

    path = tmp_path / "etc" / "node.json"
    printed = run("credential", "cpu-01", "--write", str(path), "--server", "https://berth.example")
    assert "bnc_" not in printed and stat.S_IMODE(path.stat().st_mode) == 0o600
    written = json.loads(path.read_text())
    assert written["node"] == "cpu-01" and written["server"] == "https://berth.example"
    assert enrolment.authenticate(written["credential"]) == cpu_node
    run("credential", "cpu-01", "--write", str(path))  # again: rotated, still 0600, no server
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "server" not in json.loads(path.read_text())
    assert enrolment.authenticate(written["credential"]) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["node.json"]  # no partial left behind

    listed = run("list")
    assert "cpu-01" in listed and "active" in listed
    run("revoke", "cpu-01")
    assert enrolment.authenticate(json.loads(path.read_text())["credential"]) is None
    assert "revoked" in run("list")
    with pytest.raises(Exception, match="node_not_found"):
        run("revoke", "nobody")


def test_nodes_credential_registers_a_new_node_with_an_address(tmp_path):
    path = tmp_path / "node.json"
    run("credential", "control", "--address", "127.0.0.1", "--write", str(path))
    node = Node.objects.get(name="control")
    assert enrolment.authenticate(json.loads(path.read_text())["credential"]) == node
    printed = run("credential", "control")
    assert enrolment.authenticate(printed.split()[-1]) == node


# --- the console ------------------------------------------------------------------------------------

def test_the_console_shows_a_token_once_to_staff(staff, personas):
    client = Client()
    client.force_login(staff)
    assert "Enrol a node" in client.get("/fleet/").content.decode()
    assert client.get("/fleet/enrol/").status_code == 200
    page = client.post("/fleet/enrol/", {"name": "gpu-12", "expires_minutes": 30})
    assert page.status_code == 200
    assert "no-store" in page["Cache-Control"] or "no-cache" in page["Cache-Control"]
    text = page.content.decode()
    row = EnrolmentToken.objects.get()
    start = text.index(f"bne_{row.lookup}_")
    token = text[start:].split("<", 1)[0].split()[0]
    assert f"--token {token}" in text and "--server http://testserver" in text
    assert enrol(token).json()["node"]["name"] == "gpu-12"
    for later in ("/fleet/", "/fleet/enrol/", f"/fleet/nodes/{Node.objects.get().public_id}/"):
        assert token not in client.get(later).content.decode()

    outsider = Client()
    outsider.force_login(personas.max)
    assert "Enrol a node" not in outsider.get("/fleet/").content.decode()
    assert outsider.get("/fleet/enrol/").status_code == 403
    assert outsider.post("/fleet/enrol/", {"expires_minutes": 30}).status_code == 403
    assert EnrolmentToken.objects.count() == 1


def test_the_console_says_a_refusal_on_the_enrol_page(staff, cpu_node):
    enrolment.issue_credential(BERTH, cpu_node)
    client = Client()
    client.force_login(staff)
    page = client.post("/fleet/enrol/", {"name": "cpu-01", "expires_minutes": 30})
    assert page.status_code == 409 and "enrolled already" in page.content.decode()
    assert not EnrolmentToken.objects.exists()


def test_the_revoke_button_is_staffs_and_works(staff, personas, cpu_node):
    enrolment.issue_credential(BERTH, cpu_node)
    page = f"/fleet/nodes/{cpu_node.public_id}/"
    member = Client()
    member.force_login(personas.max)
    text = member.get(page).content.decode()
    assert "Revoke credential" not in text and 'data-credential="active"' in text
    assert member.post(f"{page}revoke/").status_code == 403
    cpu_node.refresh_from_db()
    assert cpu_node.revoked_at is None

    operator = Client()
    operator.force_login(staff)
    assert "Revoke credential" in operator.get(page).content.decode()
    answer = operator.post(f"{page}revoke/")
    assert answer.status_code == 302 and answer["Location"] == page
    cpu_node.refresh_from_db()
    assert cpu_node.revoked_at is not None
    text = operator.get(page).content.decode()
    assert 'data-credential="revoked"' in text and "Revoke credential" not in text
    assert f"/fleet/enrol/?existing={cpu_node.name}" in text
