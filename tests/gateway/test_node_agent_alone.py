"""The node agent with nothing of the cluster but the server's URL and its own credential: no
database, broker, secret key or pepper in its environment. Through it a real llama-server is
started, watched, reported ready and served through the gateway, stopped, and — killed — reported
failed with its log tail. Its credential revoked, it is refused at once and ends, saying so."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from scheduler import enrolment
from scheduler.models import Node
from serving.deployments import service
from serving.models import Deployment, Replica
from tenancy.audit import Actor
from tests.assets.agent import CLUSTER_SETTINGS, NODE, Agent
from tests.assets.waiting import wait_until

ADMIN = Actor(system="tests")
pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def _state(deployment: Deployment) -> str:
    deployment.refresh_from_db()
    return deployment.state


def _environment_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode(errors="replace").split("=", 1) for pair in pairs if b"=" in pair)


def test_an_agent_with_only_its_credential_runs_serves_stops_and_reports_a_killed_engine(
        tmp_path, settings, tiny_model, gateway, make_key, live_server):
    model_root = tmp_path / "models"
    model_root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [model_root.resolve()]
    model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
    agent = Agent(tmp_path, model_root, live_server.url)
    try:
        environment = _environment_of(agent.process.pid)
        assert not set(CLUSTER_SETTINGS) & set(environment), "the agent holds a cluster setting"
        node = Node.objects.get(name=NODE)
        deployment = service.deploy(ADMIN, service.DeployRequest(name="alone", model_path=str(model), node=node,
                                                                 config={"context": 256}))
        wait_until(lambda: _state(deployment) in ("ready", "failed"), 120, what="the deployment settled")
        assert deployment.state == "ready", list(deployment.events.values_list("message", "log_tail"))
        assert list(deployment.events.values_list("to_state", flat=True)) == ["starting", "loading", "ready"]
        replica = deployment.replica_set.get()
        assert replica.peak_memory_bytes and replica.peak_memory_bytes > 0  # measured on the node, reported

        answer = gateway.openai(make_key().key).completions.create(model="alone", prompt="hello", max_tokens=3,
                                                                     extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 3

        service.stop(ADMIN, deployment)
        wait_until(lambda: _state(deployment) == "stopped", 60, what="stopped")
        with pytest.raises(ProcessLookupError):
            os.kill(replica.handle["pid"], 0)

        service.start(ADMIN, deployment)
        wait_until(lambda: _state(deployment) == "ready", 120, what="ready again")
        again = deployment.replica_set.exclude(pk=replica.pk).get()
        os.kill(again.handle["pid"], signal.SIGKILL)
        wait_until(lambda: Replica.objects.get(pk=again.pk).state == "failed", 30, what="the killed engine reported")
        failure = again.events.get(to_state="failed")
        assert "SIGKILL" in failure.message
        assert "llama" in failure.log_tail or "server" in failure.log_tail, failure.log_tail[-500:]

        # The agent never opened a database of its own either (the embedded default's file).
        assert not list((tmp_path / "agent-data").glob("**/*.sqlite3"))

        enrolment.revoke(ADMIN, node)
        wait_until(lambda: agent.process.poll() is not None, 30, what="the revoked agent ended")
        assert agent.process.returncode != 0
        assert "refuses this node's credential" in agent.log_path.read_text()
    finally:
        agent.stop()
