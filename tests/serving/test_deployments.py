"""Deployments end to end: a real agent (a Celery worker on the node's queue) starts real
llama-server engines; the gate, readiness, failure and stop paths are observed in the rows."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from serving.deployments import service
from serving.keys import replica_key
from serving.models import Deployment, DeploymentEvent, Replica
from tenancy.audit import Actor
from tests.assets.agent import NODE, Agent
from tests.assets.waiting import wait_until

ADMIN = Actor(system="tests")

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]








def state_of(deployment: Deployment) -> str:
    deployment.refresh_from_db()
    return deployment.state


def deploy(name: str, model: Path, **config) -> Deployment:
    request = service.DeployRequest(name=name, model_path=str(model), node=_node(), config={"context": 256, **config})
    return service.deploy(ADMIN, request)


def _node():
    from scheduler.models import Node

    return Node.objects.get(name=NODE)


def test_deploy_becomes_ready_and_serves_a_real_completion(agent, model_root, tiny_model):
    model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
    deployment = deploy("tiny", model)
    wait_until(lambda: state_of(deployment) in ("ready", "failed"), 120, what="the deployment settled")
    assert deployment.state == "ready", list(deployment.events.values_list("message", "log_tail"))
    replica = deployment.replica_set.get()
    assert replica.peak_memory_bytes and replica.peak_memory_bytes > 0
    response = httpx.post(f"http://127.0.0.1:{replica.port}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {replica_key(replica.public_id)}"},
                          json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    refused = httpx.post(f"http://127.0.0.1:{replica.port}/v1/completions", timeout=10, json={"prompt": "hello"})
    assert refused.status_code == 401  # only the gateway holds the replica's key
    transitions = list(deployment.events.values_list("to_state", flat=True))
    assert transitions == ["starting", "loading", "ready"]


def test_a_draft_model_is_reserved_and_loaded_beside_the_model(agent, model_root, tiny_model):
    from scheduler import memory

    model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
    draft = Path(shutil.copy(tiny_model, model_root / "tiny-draft.gguf"))  # the same vocabulary, by construction
    alone = memory.estimate_and_fit(model, "llamacpp", {"ctx_size": 256}).estimate
    deployment = deploy("drafted", model, draft_model=str(draft), draft_max=4)
    both = deployment.estimate
    assert [p["name"] for p in both["parts"]][-1] == "draft" and both["inputs"]["draft"]["bytes"] > 0
    assert deployment.memory_reserved_bytes == alone.total_bytes + both["inputs"]["draft"]["bytes"]
    wait_until(lambda: state_of(deployment) in ("ready", "failed"), 120, what="the deployment settled")
    assert deployment.state == "ready", list(deployment.events.values_list("message", "log_tail"))
    replica = deployment.replica_set.get()
    argv = Path(f"/proc/{replica.handle['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"-md") + 1] == str(draft).encode()
    response = httpx.post(f"http://127.0.0.1:{replica.port}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {replica_key(replica.public_id)}"},
                          json={"prompt": "hello", "max_tokens": 6, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 6
    outside = deploy_refused("outside", model, draft_model="/etc/hosts.gguf")
    assert outside.code == "model_outside_roots"


def deploy_refused(name: str, model: Path, **config):
    from berth.errors import BerthError

    with pytest.raises(BerthError) as refused:
        deploy(name, model, **config)
    return refused.value


def test_corrupt_model_fails_and_keeps_the_log_tail(agent, model_root, tiny_model):
    model = model_root / "corrupt.gguf"
    data = tiny_model.read_bytes()
    model.write_bytes(data[: len(data) // 3])  # a real header, truncated tensors
    deployment = deploy("corrupt", model)
    wait_until(lambda: state_of(deployment) in ("ready", "failed"), 120, what="the deployment settled")
    assert deployment.state == "failed"
    failure = deployment.events.get(to_state="failed")
    assert "while loading" in failure.message or "could not start" in failure.message
    assert failure.log_tail.strip()  # what llama-server said about the file
    from scheduler.models import MemoryReservation

    assert not MemoryReservation.objects.exists()  # what it held was given back


def test_sigkill_is_reported_as_sigkill_not_oom(agent, model_root, tiny_model):
    model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
    deployment = deploy("victim", model)
    wait_until(lambda: state_of(deployment) in ("ready", "failed"), 120, what="the deployment ready")
    replica = deployment.replica_set.get()
    os.kill(replica.handle["pid"], signal.SIGKILL)
    wait_until(lambda: state_of(deployment) == "failed", 30, what="the liveness check noticed")
    failure = deployment.events.get(to_state="failed")
    assert "SIGKILL" in failure.message and "memory" not in failure.message


def test_second_deploy_waits_for_the_start_up_gate(agent, model_root, gguf_model):
    first = deploy("first", Path(shutil.copy(gguf_model("a.gguf", layers=2), model_root / "a.gguf")))
    second = deploy("second", Path(shutil.copy(gguf_model("b.gguf", layers=3), model_root / "b.gguf")))
    wait_until(lambda: state_of(first) == "ready" and state_of(second) == "ready", 180, what="both ready")
    events = list(DeploymentEvent.objects.order_by("at", "id").values_list("deployment__name", "to_state"))
    # With one slot, one of them waited as queued until the other was ready.
    queued = [name for name, state in events if state == "queued"]
    assert len(queued) == 1
    other = "first" if queued[0] == "second" else "second"
    assert events.index((other, "ready")) < events.index((queued[0], "starting"))


def test_stop_stops_the_engine_and_releases_its_memory(agent, model_root, tiny_model):
    model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
    deployment = deploy("tiny", model)
    wait_until(lambda: state_of(deployment) == "ready", 120, what="ready")
    pid = deployment.replica_set.get().handle["pid"]
    service.stop(ADMIN, deployment)
    wait_until(lambda: state_of(deployment) == "stopped", 60, what="stopped")
    from scheduler.models import MemoryReservation

    assert not MemoryReservation.objects.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    service.remove(ADMIN, deployment)
    assert not Deployment.objects.filter(pk=deployment.pk).exists()


def test_agent_restart_adopts_the_running_engine(tmp_path, model_root, node, tiny_model, live_server):
    first = Agent(tmp_path, model_root, live_server.url)
    try:
        model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
        deployment = deploy("tiny", model)
        wait_until(lambda: state_of(deployment) == "ready", 120, what="ready")
    finally:
        first.stop()
    replica = deployment.replica_set.get()
    os.kill(replica.handle["pid"], 0)  # the engine outlived its agent
    second = Agent(tmp_path, model_root, live_server.url, log_name="agent-after-restart.log")
    try:
        service.stop(ADMIN, deployment)
        wait_until(lambda: state_of(deployment) == "stopped", 60, what="the new agent stopped the adopted engine")
    finally:
        second.stop()


@pytest.mark.docker
def test_docker_runtime_deploys_a_ready_container(agent, model_root, tiny_model):
    import docker

    model = Path(shutil.copy(tiny_model, model_root / "tiny.gguf"))
    request = service.DeployRequest(name="boxed", model_path=str(model), node=_node(), runtime="docker",
                                    config={"context": 256})
    deployment = service.deploy(ADMIN, request)
    wait_until(lambda: state_of(deployment) in ("ready", "failed"), 180, what="the container settled")
    assert deployment.state == "ready", list(deployment.events.values_list("message", "log_tail"))
    replica = deployment.replica_set.get()
    container = docker.from_env().containers.get(replica.handle["container_id"])
    assert container.labels["berth.replica"] == str(replica.public_id)
    assert container.attrs["HostConfig"]["NetworkMode"] == "host"
    response = httpx.post(f"http://127.0.0.1:{replica.port}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {replica_key(replica.public_id)}"},
                          json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200
    service.stop(ADMIN, deployment)
    wait_until(lambda: state_of(deployment) == "stopped", 60, what="the container stopped")
    assert not docker.from_env().containers.list(all=True, filters={"label": f"berth.replica={replica.public_id}"})


def test_a_queued_deploy_that_no_longer_fits_at_its_turn_fails_with_the_reason(agent, model_root, tiny_model):
    from scheduler.models import MemoryReservation
    from serving.deployments import states

    # Another engine holds the node's one start-up slot: a replica starting there (two deploys racing
    # for it would take it in whichever order their agents' claims land).
    busy = Deployment.objects.create(name="slot-holder", model_path=str(tiny_model), node=_node(), state="starting")
    holder = Replica.objects.create(deployment=busy, node=_node(), port=29999, state="starting")
    second = deploy("second", Path(shutil.copy(tiny_model, model_root / "tiny.gguf")))
    try:
        wait_until(lambda: state_of(second) == "queued", 30, what="the deploy queued behind the starting one")
    except TimeoutError:  # what happened instead: each deployment's events
        pytest.fail(str(list(DeploymentEvent.objects.order_by("at", "id").values_list("deployment__name", "message"))))
    # While it waits, something else takes the node's memory; then the slot frees.
    MemoryReservation.objects.create(node=_node(), holder="elsewhere", bytes=_node().memory_total_bytes)
    states.move(holder, "failed", "the engine holding the slot failed")
    wait_until(lambda: state_of(second) == "failed", 30, what="the queued deploy failed at its turn")
    assert "no longer fits at its turn" in second.events.get(to_state="failed").message
    assert not second.replica_set.get().handle  # it never launched
    MemoryReservation.objects.filter(holder="elsewhere").delete()


def test_an_engine_running_without_a_record_is_adopted_as_unknown(tmp_path, model_root, node, tiny_model,
                                                                  process_runtime, launch_spec, live_server):
    import uuid

    from serving.engines.llamacpp import LlamaCpp

    spec = launch_spec(tiny_model, replica_id=str(uuid.uuid4()), served_name="stray",
                       config=LlamaCpp().validate_config({"context": 256}))
    handle = process_runtime.start(spec, LlamaCpp().command(spec))  # a record lost, an engine still running
    running = Agent(tmp_path, model_root, live_server.url)  # its engines directory is the same tmp_path / "engines"
    try:
        replica = wait_until(lambda: Replica.objects.filter(public_id=spec.replica_id).first(), 30,
                             what="the stray engine adopted")
        assert replica.state == "unknown" and replica.port == spec.port
        assert replica.deployment.name == "stray" and replica.deployment.state == "unknown"
        service.stop(ADMIN, replica.deployment)
        wait_until(lambda: state_of(replica.deployment) == "stopped", 60, what="the adopted engine stopped")
        assert not process_runtime.status(handle).running
    finally:
        running.stop()
