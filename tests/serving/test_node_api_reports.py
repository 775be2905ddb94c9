"""The node API's heartbeat and the agent's enrolment, from the node's side: a node reports only what
is its own (another node's name or replica is refused, 403, and audited), a malformed report is a 400
that registers nothing, a revoked node is refused at once, and `manage.py agent --enrol-only` spends
its token once for a credential kept readable by its user alone."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid

import pytest
from django.test import Client

from scheduler import enrolment
from scheduler.models import Node
from scheduler.services import NodeReport, register_node
from serving.models import Deployment, Replica
from serving.node.client import CLUSTER_SETTINGS, Credential
from serving.node.discovery import local_node_report
from serving.runtimes.base import Handle
from tenancy.audit import Actor
from tenancy.models import AuditEvent
from tests.assets.agent import ROOT

ADMIN = Actor(system="tests")
pytestmark = pytest.mark.django_db


def _node(name: str) -> tuple[Node, str]:
    node = register_node(NodeReport(name=name, address="127.0.0.1"))
    return node, enrolment.issue_credential(ADMIN, node)


def _beat(credential: str, body: dict):
    return Client().post("/api/node/heartbeat/", data=json.dumps(body), content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {credential}")


def _report(name: str) -> dict:
    return dataclasses.asdict(dataclasses.replace(local_node_report(), name=name))


def test_a_node_beats_for_itself_and_its_report_registers_it():
    node, credential = _node("beating")
    answer = _beat(credential, {"report": _report("beating"), "engines": [], "first": True})
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"expected": []}
    node.refresh_from_db()
    assert node.last_heartbeat_at is not None and node.memory_total_bytes == local_node_report().memory_total_bytes


def test_a_heartbeat_under_another_nodes_name_is_refused_and_audited():
    mine, _ = _node("node-a")
    _, theirs = _node("node-b")
    beaten = mine.last_heartbeat_at
    report = {**_report("node-a"), "address": "127.0.0.8"}
    answer = _beat(theirs, {"report": report, "engines": []})
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "node_ownership_mismatch"
    mine.refresh_from_db()
    assert (mine.address, mine.last_heartbeat_at) == ("127.0.0.1", beaten)  # node-a's row untouched
    event = AuditEvent.objects.get(action="node.ownership_mismatch")
    assert event.actor == "node:node-b" and event.details["node"] == "node-b"


def test_a_heartbeat_about_another_nodes_replica_is_refused_and_audited():
    mine, _ = _node("node-a")
    _, theirs = _node("node-b")
    deployment = Deployment.objects.create(name="theirs", model_path="/m.gguf", node=mine, state="ready")
    replica = Replica.objects.create(deployment=deployment, node=mine, port=20500, state="ready")
    dead = {"handle": dataclasses.asdict(Handle(runtime="process", replica_id=str(replica.public_id), pid=1)),
            "running": False, "log_tail": "forged"}
    answer = _beat(theirs, {"report": _report("node-b"), "engines": [dead]})
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "node_ownership_mismatch"
    replica.refresh_from_db()
    assert replica.state == "ready"  # not failed on another node's word
    assert AuditEvent.objects.filter(action="node.ownership_mismatch", details__object=str(replica.public_id)).exists()


@pytest.mark.parametrize("body, says", [
    ({"engines": []}, "report"),
    ({"report": {"name": "node-a"}}, "address"),
    ({"report": {"name": "node-a", "address": "127.0.0.1", "cpu_count": "many"}}, "cpu_count"),
    ({"report": {"name": "node-a", "address": "127.0.0.1", "colour": "blue"}}, "colour"),
    ({"report": {"name": "node-a", "address": "127.0.0.1"}, "engines": [{"running": True}]}, "handle"),
])
def test_a_malformed_heartbeat_is_refused_with_a_code_and_registers_nothing(body, says):
    node, credential = _node("node-a")
    beaten = node.last_heartbeat_at
    answer = _beat(credential, body)
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] in ("invalid_node_report", "invalid") and says in json.dumps(error)
    node.refresh_from_db()
    assert node.last_heartbeat_at == beaten


def test_a_revoked_nodes_heartbeat_is_refused_at_once():
    node, credential = _node("node-a")
    assert _beat(credential, {"report": _report("node-a")}).status_code == 200
    enrolment.revoke(ADMIN, node)
    answer = _beat(credential, {"report": _report("node-a")})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "node_revoked"


def test_a_management_credential_is_not_a_node_credential(admin_user):
    client = Client()
    client.force_login(admin_user)
    answer = client.post("/api/node/heartbeat/", data=json.dumps({"report": _report("x")}),
                         content_type="application/json")
    assert answer.status_code in (401, 403)
    assert not Node.objects.filter(name="x").exists()


@pytest.mark.django_db(transaction=True)
def test_enrol_only_spends_the_token_once_for_a_credential_only_its_user_reads(tmp_path, live_server):
    _, token = enrolment.issue_token(ADMIN, name=f"enrolled-{uuid.uuid4().hex[:6]}")
    path = tmp_path / "node" / "credential"
    env = {key: value for key, value in os.environ.items() if key not in CLUSTER_SETTINGS}
    env["BERTH_DATA_DIR"] = str(tmp_path / "agent-data")

    def enrol():
        return subprocess.run([sys.executable, "manage.py", "agent", "--enrol-only", "--server", live_server.url,
                               "--token", token, "--credential-file", str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    first = enrol()
    assert first.returncode == 0, first.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    credential = Credential.load(path)
    assert credential.node.startswith("enrolled-") and credential.server == live_server.url
    assert enrolment.authenticate(credential.credential).name == credential.node
    again = enrol()
    assert again.returncode != 0 and "enrolment_token_spent" in again.stderr
    assert Credential.load(path) == credential  # the refusal lost nothing
