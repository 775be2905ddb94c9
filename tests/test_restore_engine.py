"""A restore keeps a running engine serving: with a real agent running a real llama-server replica, the
database is backed up and restored into a fresh one; an agent started on the restored database adopts
the engine that still runs (same process, the replica still ready, its node beating there), a gateway
on the restored database answers a chat request with a key made before the backup — through that
engine, whose key derives from the secret key and the replica's id, both restored with the archive —
and refuses a key made after it; the restored control plane can then stop the engine.

The backup's own checks (every key authenticates, the API's reads, the refusals) are tests/test_backup.py."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import openai
import pytest
from django.db import connection

from serving.deployments import service
from serving.deployments.request import DeployRequest
from tenancy.audit import Actor
from tenancy.services import clients
from tenancy.services.tree import create_scope
from tests.assets.agent import NODE, Agent
from tests.assets.database import database_environ
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess
from tests.serving.conftest import model_root, node, process_runtime  # noqa: F401  (fixtures)
from tests.test_backup import _manage, fresh_database

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]

ADMIN = Actor(system="tests")
MODEL = "restored-chat"

# Read in the restored database: the node's last heartbeat, the replica's state and engine.
STATE = f"""
import json
from scheduler.models import Node
from serving.models import Replica
node = Node.objects.get(name={NODE!r})
replica = Replica.objects.get(deployment__name={MODEL!r})
print("STATE " + json.dumps({{"heartbeat": node.last_heartbeat_at.timestamp(), "state": replica.state,
                              "pid": (replica.handle or {{}}).get("pid")}}))
"""
STOP = f"""
from serving.deployments import service
from serving.models import Deployment
from tenancy.audit import Actor
service.stop(Actor(system="tests"), Deployment.objects.get(name={MODEL!r}))
"""


def _restored_state(environ: dict) -> dict:
    done = _manage(["shell", "-c", STATE], environ)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("STATE ", 1)[1])


def _inference_key(name: str) -> str:
    org = create_scope(ADMIN, "org", "o" + uuid.uuid4().hex[:10], "Org")
    project = create_scope(ADMIN, "project", "app", "App", create_scope(ADMIN, "team", "ml", "ML", org))
    client = clients.create_client(ADMIN, project, name, all_models=True, access="inference")
    return clients.create_credential(ADMIN, client)[1]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_restored_database_adopts_the_running_engine_and_serves_keys_made_before_the_backup(
        process_runtime, node, model_root, smollm2_model, tmp_path, live_server):
    # (process_runtime first: torn down last, it stops an engine the test left running)
    key_before = _inference_key("before-backup")
    first = Agent(tmp_path, model_root, live_server.url)
    try:
        model = Path(shutil.copy(smollm2_model, model_root / "smollm2.gguf"))
        deployment = service.deploy(ADMIN, DeployRequest(name=MODEL, model_path=str(model), node=node,
                                                         config={"context": 1024}))
        wait_until(lambda: deployment.replica_set.filter(state__in=("ready", "failed")).exists(), 180,
                   what="the replica settled")
        replica = deployment.replica_set.get()
        assert replica.state == "ready", list(deployment.events.values_list("message", flat=True))
        made = _manage(["backup", "--dir", str(tmp_path / "backups")], database_environ(connection.settings_dict))
        assert made.returncode == 0, made.stderr
    finally:
        first.stop()  # SIGTERM: the engine outlives its agent
    archive = made.stdout.split("Backup written: ", 1)[1].splitlines()[0]
    pid = replica.handle["pid"]
    assert _running(pid)
    key_after = _inference_key("after-backup")  # in the old database only

    with fresh_database(tmp_path) as environ:
        restored = _manage(["restore", archive], environ)
        assert restored.returncode == 0, restored.stderr
        restored_at = time.time()
        # The restored control plane's web server; the node's agent comes back to it with the credential
        # it held before (the restored database knows it: it was issued before the backup).
        gateway = GatewayProcess(tmp_path / "gateway-restored.log", environ=environ)
        second = Agent(tmp_path, model_root, gateway.base_url, log_name="agent-restored.log",
                       credential=first.credential)
        try:
            # Beats a second apart: two after the restore mean the adopted engine was checked alive.
            state = wait_until(lambda: (s := _restored_state(environ))["heartbeat"] > restored_at + 2 and s, 60,
                               interval=0.5, what="the agent beating in the restored database")
            assert (state["state"], state["pid"]) == ("ready", pid)  # the same engine, adopted, not restarted
            assert _running(pid)

            answer = gateway.openai(key_before).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
            assert answer.model == MODEL and answer.choices[0].message.content
            assert answer.usage.completion_tokens >= 1
            with pytest.raises(openai.AuthenticationError):  # it was never in the restored database
                gateway.openai(key_after).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

            stopped = _manage(["shell", "-c", STOP], environ)
            assert stopped.returncode == 0, stopped.stderr[-3000:]
            wait_until(lambda: not _running(pid), 60, what="the restored control plane's agent stopping the engine")
            assert wait_until(lambda: _restored_state(environ)["state"] == "stopped", 30, interval=0.5,
                              what="the replica stopped in the restored database")
        finally:
            second.stop()
            gateway.stop()
