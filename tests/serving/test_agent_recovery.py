"""The agent tells the recovery ladder about launches that failed: a real llama-server that cannot
load its file is a crash, one that never answers is a hang, an exit with out-of-memory evidence is
an oom; a replica that becomes ready resets the model's memory. Failures that are not the model's
(no room at its turn, the queue timeout) and deployments the catalog does not know are not counted."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from scheduler.models import RecoveryState
from serving import queues
from serving.control import failures, node_reports
from serving.deployments import service
from serving.models import Deployment, ModelEntry, Replica
from serving.runtimes.base import Exit
from tenancy.audit import Actor
from tests.assets.agent import NODE, Agent
from tests.assets.llama_server import free_port
from tests.assets.node_inline import InlineClient, run_next
from tests.assets.waiting import wait_until

ADMIN = Actor(system="tests")


def catalog_entry(name: str, fingerprint: str = "fp-1") -> ModelEntry:
    return ModelEntry.objects.create(name=name, source_kind="local", format="gguf", fingerprint=fingerprint)


def deploy(name: str, model: Path, **fields) -> Deployment:
    from scheduler.models import Node

    node = Node.objects.get(name=NODE)
    return service.deploy(ADMIN, service.DeployRequest(name=name, model_path=str(model), node=node,
                                                       config={"context": 256}, **fields))


def settled(deployment: Deployment) -> bool:
    deployment.refresh_from_db()
    return deployment.state in ("ready", "failed")


def recovery_of(name: str) -> RecoveryState | None:
    return RecoveryState.objects.filter(model=name).first()


def corrupt_copy(tiny_model: Path, target: Path) -> Path:
    data = tiny_model.read_bytes()
    target.write_bytes(data[: len(data) // 3])  # a real header, truncated tensors
    return target


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_catalog_model_that_cannot_load_is_a_crash_and_a_hand_made_one_is_not_counted(agent, model_root,
                                                                                        tiny_model):
    catalog_entry("corrupt")
    model = corrupt_copy(tiny_model, model_root / "corrupt.gguf")
    deployment = deploy("corrupt", model)
    wait_until(lambda: settled(deployment), 120, what="the deployment settled")
    assert deployment.state == "failed"
    row = wait_until(lambda: recovery_of("corrupt"), 10, what="the failure noted")
    assert (row.kind, row.consecutive, row.parked, row.fingerprint) == ("crash", 1, False, "fp-1")
    assert "while loading" in row.last_error or "could not start" in row.last_error

    by_hand = deploy("by-hand", model)  # the same broken file under a name the catalog does not know
    wait_until(lambda: settled(by_hand), 120, what="the hand-made deployment settled")
    assert by_hand.state == "failed" and recovery_of("by-hand") is None


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_ready_replica_resets_the_models_failure_memory(agent, model_root, tiny_model):
    catalog_entry("tiny")
    RecoveryState.objects.create(model="tiny", kind="crash", consecutive=2, last_failure_at=timezone.now(),
                                 last_error="engine exited with status 1 while loading")
    deployment = deploy("tiny", Path(shutil.copy(tiny_model, model_root / "tiny.gguf")))
    wait_until(lambda: settled(deployment), 120, what="the deployment settled")
    assert deployment.state == "ready"
    wait_until(lambda: recovery_of("tiny").consecutive == 0, 10, what="the memory reset")
    assert recovery_of("tiny").kind == ""


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_an_engine_that_never_becomes_ready_is_a_hang(tmp_path, model_root, node, tiny_model, live_server):
    """A chat model deployed as a reranker: /health answers, the real rerank request never does,
    so the start-up timeout (5 s here) passes."""
    catalog_entry("never-ready")
    running = Agent(tmp_path, model_root, live_server.url, startup_timeout=5)
    try:
        deployment = deploy("never-ready", Path(shutil.copy(tiny_model, model_root / "tiny.gguf")), task="rerank")
        wait_until(lambda: settled(deployment), 120, what="the deployment settled")
        assert deployment.state == "failed"
        assert "not ready within 5s" in deployment.events.get(to_state="failed").message
        row = wait_until(lambda: recovery_of("never-ready"), 10, what="the failure noted")
        assert (row.kind, row.consecutive) == ("hang", 1)
    finally:
        running.stop()


# --- the classification of what the agent reports, in process ------------------------------------------

def _replica(node, model_root, tiny_model, name: str, state: str, **fields) -> Replica:
    model = Path(shutil.copy(tiny_model, model_root / f"{name}.gguf"))
    reserved = fields.pop("memory_reserved_bytes", 2**20)
    deployment = Deployment.objects.create(name=name, model_path=str(model), node=node, state=state,
                                           config={"context": 256}, memory_reserved_bytes=reserved)
    return Replica.objects.create(deployment=deployment, node=node, port=free_port(), state=state,
                                  memory_reserved_bytes=reserved, **fields)


@pytest.mark.django_db
def test_an_exit_with_out_of_memory_evidence_while_loading_is_an_oom(node, model_root, tiny_model):
    catalog_entry("big")
    replica = _replica(node, model_root, tiny_model, "big", "loading")
    failures.record(replica, "engine out of memory (Docker OOMKilled) while loading",
                    exit=Exit(code=137, signal=9, oom_evidence="Docker OOMKilled"), launch_failure="crash")
    row = recovery_of("big")
    assert (row.kind, row.consecutive, row.level) == ("oom", 1, 1)  # the ladder degrades it next


@pytest.mark.django_db
def test_a_sigkill_without_evidence_while_loading_stays_a_crash(node, model_root, tiny_model):
    catalog_entry("killed")
    replica = _replica(node, model_root, tiny_model, "killed", "loading")
    failures.record(replica, "engine killed by SIGKILL while loading", exit=Exit(code=None, signal=9),
                    launch_failure="crash")
    assert recovery_of("killed").kind == "crash"


@pytest.mark.django_db
def test_no_room_at_its_turn_is_not_the_models_failure(node, model_root, tiny_model):
    catalog_entry("crowded")
    replica = _replica(node, model_root, tiny_model, "crowded", "planned",
                       memory_reserved_bytes=(node.memory_total_bytes or 2**40) * 4)
    job = queues.to_node("start", replica)
    assert run_next(InlineClient(node), "start") is None  # admitted at its claim: at its turn, it no longer fits
    replica.refresh_from_db()
    assert replica.state == "failed" and "no longer fits at its turn" in replica.exit_reason
    assert recovery_of("crowded") is None
    job.refresh_from_db()
    assert job.state == "cancelled"  # nothing was handed to the node, nothing launched


@pytest.mark.django_db
def test_the_queue_timeout_is_not_the_models_failure(node, model_root, tiny_model, settings):
    catalog_entry("waited")
    replica = _replica(node, model_root, tiny_model, "waited", "queued")
    Replica.objects.filter(pk=replica.pk).update(
        queued_at=timezone.now() - timedelta(seconds=settings.SERVING_QUEUE_TIMEOUT_SECONDS + 60))
    node_reports.beat(node, [], first=False)  # the node's next heartbeat, as the control plane takes it
    replica.refresh_from_db()
    assert replica.state == "failed" and "for a start-up slot" in replica.exit_reason
    assert recovery_of("waited") is None
