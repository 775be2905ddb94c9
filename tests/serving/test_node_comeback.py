"""A node that comes back after being marked lost: its replicas were failed (their reservations
given back) while its engines kept running. The agent reconciles what it finds with what the
database says, whichever came first: a ready replica whose engine still runs is taken back (same
engine, ready again, its memory and contract share claimed once more); one that a newer replica
of its name replaced, or whose memory is no longer free, has its engine stopped, the reason kept.
No duplicate is ever placed beside an engine that still holds the memory."""

from __future__ import annotations

import dataclasses
import os
import shutil
from datetime import timedelta

import httpx
import pytest
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from scheduler.models import MemoryReservation, Node
from scheduler.services import mark_lost_nodes, register_node
from serving.catalog.entries import import_local
from serving.control import placement, reconcile
from serving.deployments import service
from serving.deployments.states import holder_of
from serving.keys import replica_key
from serving.models import Deployment, ModelEntry, Replica
from serving.node import runtime as node_runtime
from serving.node.discovery import local_node_report
from serving.runtimes.base import Handle
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets import node_inline
from tests.assets.agent import NODE, Agent
from tests.assets.waiting import wait_until

ADMIN = Actor(system="tests")

pytestmark = pytest.mark.llama


@pytest.fixture(autouse=True)
def nothing_remembered():
    from django.core.cache import cache

    cache.clear()  # placement's holds and scaling states of earlier tests must not count here


def always_on(tiny_model, tmp_path, name: str = "kept") -> ModelEntry:
    entry = import_local(ADMIN, shutil.copy(tiny_model, tmp_path / f"{name}.gguf"), name=name)
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1,
                                                  profiles=[{**entry.profiles[0], "context": 256}])
    return ModelEntry.objects.get(pk=entry.pk)


def state_of(replica: Replica) -> str:
    replica.refresh_from_db()
    return replica.state


def lost_and_failed_as_beat_would() -> int:
    """More than ``SCHEDULER_NODE_LOST_AFTER`` without a heartbeat: beat's lost-node check, then its
    reconcile pass (which fails the lost node's replicas and places what is missing, nowhere here).
    One transaction: an agent still beating waits for it, so the failure is seen before the return."""
    later = timezone.now() + timedelta(seconds=settings.SCHEDULER_NODE_LOST_AFTER + 1)
    with transaction.atomic():
        assert mark_lost_nodes(now=later) == [NODE]
        return reconcile.fail_replicas_of_lost_nodes()


def assert_taken_back(replica: Replica, pid: int) -> None:
    replica.refresh_from_db()
    assert replica.state == "ready" and replica.handle["pid"] == pid and replica.exit_reason == ""
    os.kill(pid, 0)  # the same engine, never restarted
    assert "its node came back and its engine still runs" in replica.events.latest("at", "pk").message
    assert list(MemoryReservation.objects.values_list("holder", flat=True)) == [holder_of(replica)]  # once
    assert placement.reconcile()["launched"] == []  # the model has its replica: nothing placed beside it
    assert Replica.objects.filter(deployment__name=replica.deployment.name).count() == 1
    response = httpx.post(f"http://127.0.0.1:{replica.port}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {replica_key(replica.public_id)}"},
                          json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200


def beats_settle(client: node_inline.InlineClient) -> None:
    """The node's agent, in process: a beat (its answer names the engines the control plane asks
    about), a beat that reports on them, then the jobs those beats gave the node (engines to stop)."""
    node_inline.beat(client)
    node_inline.beat(client)
    node_inline.run_all(client)


def stop_everything() -> None:
    for deployment in Deployment.objects.exclude(state__in=("stopped", "failed")):
        service.stop(ADMIN, deployment)
    wait_until(lambda: not Replica.objects.exclude(state__in=("stopped", "failed")).exists(), 60,
               what="every replica stopped")


@pytest.mark.django_db(transaction=True)
def test_an_agent_back_after_its_node_was_lost_takes_its_running_engine_back(tmp_path, model_root, node,
                                                                             tiny_model, process_runtime, live_server):
    always_on(tiny_model, tmp_path)
    first = Agent(tmp_path, model_root, live_server.url)
    try:
        assert placement.reconcile()["launched"] == ["kept"]
        replica = Replica.objects.get(deployment__name="kept")
        wait_until(lambda: state_of(replica) in ("ready", "failed"), 120, what="the replica settled")
        assert replica.state == "ready"
    finally:
        first.stop()  # SIGTERM: the engine outlives its agent
    pid = replica.handle["pid"]
    os.kill(pid, 0)
    assert lost_and_failed_as_beat_would() == 1
    assert placement.reconcile()["launched"] == []  # beat's pass goes on: its only node is lost
    assert state_of(replica) == "failed" and replica.exit_reason.startswith(f"node {NODE} is lost")
    assert not MemoryReservation.objects.exists()

    second = Agent(tmp_path, model_root, live_server.url, log_name="agent-after-comeback.log")
    try:
        wait_until(lambda: state_of(replica) == "ready", 30, what="the engine taken back")
        assert_taken_back(replica, pid)
        stop_everything()
    finally:
        second.stop()


@pytest.mark.django_db(transaction=True)
def test_an_agent_whose_heartbeats_were_late_takes_its_engine_back_at_its_next_beat(process_runtime, agent,
                                                                                  tmp_path, tiny_model):
    # (process_runtime first: torn down last, it stops an engine the test failed to take back)
    always_on(tiny_model, tmp_path)
    assert placement.reconcile()["launched"] == ["kept"]
    replica = Replica.objects.get(deployment__name="kept")
    wait_until(lambda: state_of(replica) in ("ready", "failed"), 120, what="the replica settled")
    assert replica.state == "ready"
    pid = replica.handle["pid"]
    assert lost_and_failed_as_beat_would() == 1  # the agent never stopped: its next beat finds the row failed
    wait_until(lambda: state_of(replica) == "ready", 30, what="the engine taken back by the heartbeat")
    assert_taken_back(replica, pid)


# --- refusals, in process: the rule the agent applies, on a real engine -------------------------------

@pytest.fixture
def lost_replica(node, model_root, tiny_model, process_runtime, launch_spec, monkeypatch):
    """A ready replica with its real engine running, then its node lost and the replica failed as
    beat does; the node has just registered again (it came back)."""
    from serving.engines.llamacpp import LlamaCpp

    deployment = Deployment.objects.create(name="back", model_path=str(tiny_model), node=node, state="ready",
                                           config={"context": 256}, memory_reserved_bytes=64 * 2**20)
    replica = Replica.objects.create(deployment=deployment, node=node, port=0, state="ready",
                                     memory_reserved_bytes=64 * 2**20)
    spec = launch_spec(tiny_model, replica_id=str(replica.public_id), served_name="back",
                       config=LlamaCpp().validate_config({"context": 256}))
    handle = process_runtime.start(spec, LlamaCpp().command(spec))
    Replica.objects.filter(pk=replica.pk).update(port=spec.port, handle=dataclasses.asdict(handle),
                                                 started_at=timezone.now(), ready_at=timezone.now())
    MemoryReservation.objects.create(node=node, holder=holder_of(replica), bytes=64 * 2**20)
    replica.refresh_from_db()
    assert lost_and_failed_as_beat_would() == 1
    register_node(dataclasses.replace(local_node_report(), name=NODE))  # back: ready again
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": process_runtime})  # the agent's engines
    return replica, handle, process_runtime


@pytest.mark.django_db
def test_a_newer_replica_of_the_name_wins_and_the_old_engine_is_stopped(lost_replica, node):
    replica, handle, runtime = lost_replica
    newer = Deployment.objects.create(name="back", model_path=replica.deployment.model_path, node=node,
                                      state="planned", memory_reserved_bytes=64 * 2**20)
    Replica.objects.create(deployment=newer, node=node, port=replica.port + 1, state="planned",
                           memory_reserved_bytes=64 * 2**20)
    beats_settle(node_inline.InlineClient(Node.objects.get(name=NODE)))
    assert state_of(replica) == "failed" and "a newer replica of back" in replica.exit_reason
    assert not runtime.status(handle).running
    assert not MemoryReservation.objects.filter(holder=holder_of(replica)).exists()


@pytest.mark.django_db
def test_an_engine_whose_memory_is_no_longer_free_is_stopped_with_the_reason(lost_replica, node):
    replica, handle, runtime = lost_replica
    MemoryReservation.objects.create(node=node, holder="elsewhere", bytes=node.memory_total_bytes)
    client = node_inline.InlineClient(Node.objects.get(name=NODE))
    beats_settle(client)
    assert state_of(replica) == "failed" and "Not enough memory" in replica.exit_reason
    assert replica.exit_reason.startswith("its node came back but its engine was stopped")
    assert not runtime.status(handle).running
    assert list(MemoryReservation.objects.values_list("holder", flat=True)) == ["elsewhere"]
    beats_settle(client)  # settled: the next beats leave it as it is
    assert replica.events.filter(to_state="failed").count() == 2


@pytest.mark.django_db
def test_a_lost_replica_whose_engine_ended_meanwhile_is_settled_once(node, tmp_path, monkeypatch):
    deployment = Deployment.objects.create(name="gone", model_path="/nowhere.gguf", node=node, state="ready",
                                           memory_reserved_bytes=2**20)
    replica = Replica.objects.create(deployment=deployment, node=node, port=20001, state="ready",
                                     memory_reserved_bytes=2**20)
    replica.handle = dataclasses.asdict(Handle(runtime="process", replica_id=str(replica.public_id), pid=2**22 - 3,
                                               pid_start_time=1))
    replica.save(update_fields=["handle"])
    assert lost_and_failed_as_beat_would() == 1
    register_node(dataclasses.replace(local_node_report(), name=NODE))
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": ProcessRuntime(tmp_path / "engines")})
    client = node_inline.InlineClient(Node.objects.get(name=NODE))
    beats_settle(client)
    assert state_of(replica) == "failed" and "its engine no longer runs" in replica.exit_reason
    beats_settle(client)
    assert replica.events.filter(to_state="failed").count() == 2
