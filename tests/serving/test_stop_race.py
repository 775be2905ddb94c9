"""A stop that races a start: the deployment ends stopped, no engine is left running, and the
events tell what happened.

The agent's handlers are called in this process, in the order each race needs (the agent itself
runs them on a thread pool, so two of them do interleave like this); the engines are real
llama-server processes, checked by PID. One test replays the report itself on a real agent."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from django.db import connection

from scheduler.models import MemoryReservation, Node
from serving import queues
from serving.node import adopt, lifecycle as node_agent, runtime as node_runtime
from serving.deployments import gate, service, states
from serving.models import Deployment, Replica
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets.agent import NODE
from tests.assets.waiting import wait_until

ADMIN = Actor(system="tests")

pytestmark = pytest.mark.django_db(transaction=True)


class PausingRuntime:
    """The process runtime, held still right after it has launched an engine (before the agent
    records the engine's handle) until the test lets it go on."""

    def __init__(self, real: ProcessRuntime):
        self.real = real
        self.launched = threading.Event()
        self.go_on = threading.Event()
        self.pids: list[int] = []

    def start(self, spec, command):
        handle = self.real.start(spec, command)
        self.pids.append(handle.pid)
        self.launched.set()
        assert self.go_on.wait(60), "the test never let the start go on"
        return handle

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def engines(tmp_path, settings, monkeypatch, model_root, node):
    """This process as the node's agent: its own engines directory, dispatches kept for the test
    to hand over in the order it wants; every engine it launched is stopped after."""
    settings.SERVING_ENGINE_DIR = tmp_path / "engines"
    settings.SERVING_DRAIN_SECONDS = 0
    runtime = PausingRuntime(ProcessRuntime(tmp_path / "engines"))
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": runtime})
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, str(replica.public_id))))
    runtime.sent = sent
    yield runtime
    runtime.go_on.set()
    for handle in ProcessRuntime(tmp_path / "engines").managed():
        runtime.real.stop(handle, grace_seconds=5)


def deploy(model_root: Path, model: Path, name: str = "tiny") -> tuple[Deployment, Replica]:
    path = Path(shutil.copy(model, model_root / f"{name}.gguf"))
    deployment = service.deploy(ADMIN, service.DeployRequest(name=name, model_path=str(path),
                                                             node=Node.objects.get(name=NODE),
                                                             config={"context": 256}))
    return deployment, deployment.replica_set.get()


def in_thread(function, *args) -> threading.Thread:
    """An agent worker thread (its own database connection, closed when it ends)."""

    def run():
        try:
            function(*args)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def transitions(deployment: Deployment) -> list[tuple[str, str]]:
    return list(deployment.events.order_by("at", "id").values_list("from_state", "to_state"))


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def assert_nothing_held(replica: Replica) -> None:
    holder = service.holder_of(replica)
    assert not MemoryReservation.objects.filter(holder__startswith=holder).exists()


def test_a_deploy_stopped_before_its_agent_handles_the_start_never_starts(engines, model_root, tiny_model):
    engines.go_on.set()  # nothing to hold back: no engine may be launched at all
    deployment, replica = deploy(model_root, tiny_model)
    assert engines.sent == [("start", str(replica.public_id))]  # enqueued on commit, not yet handled
    assert service.stop(ADMIN, deployment).state == "stopped"
    node_agent.start_replica(str(replica.public_id))  # the start job arrives after the stop
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert transitions(deployment) == [("planned", "stopped")]
    assert deployment.events.get().message == "cancelled before it started"
    assert not engines.launched.is_set() and not engines.real.managed()
    assert_nothing_held(replica)


def test_a_stopped_or_failed_replica_is_never_claimed_for_a_start(engines, model_root, tiny_model):
    deployment, replica = deploy(model_root, tiny_model)
    service.stop(ADMIN, deployment)
    replica.refresh_from_db()
    assert not gate.claim(replica)
    with pytest.raises(states.IllegalTransition):
        states.move(replica, "starting")  # a stopped replica stays stopped: a start makes a new one
    failed = Replica.objects.filter(pk=replica.pk)
    failed.update(state="failed")
    assert not gate.claim(failed.get())
    assert transitions(deployment) == [("planned", "stopped")]


@pytest.mark.llama
def test_a_stop_while_the_engine_is_launched_stops_it_when_the_start_finishes(engines, model_root, tiny_model):
    deployment, replica = deploy(model_root, tiny_model)
    starting = in_thread(node_agent.start_replica, str(replica.public_id))
    assert engines.launched.wait(60), "the engine was never launched"
    (pid,) = engines.pids
    service.stop(ADMIN, deployment)
    assert engines.sent[-1] == ("stop", str(replica.public_id))
    node_agent.stop_replica(str(replica.public_id))
    # Only the start knows the engine it launched: the stop is recorded, not yet claimed done.
    replica.refresh_from_db()
    assert replica.state == "stopping"
    os.kill(pid, 0)  # still running, and the row does not say stopped
    engines.go_on.set()
    starting.join(60)
    assert not starting.is_alive()
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert_gone(pid)
    assert_nothing_held(replica)
    assert transitions(deployment) == [("planned", "starting"), ("starting", "stopping"), ("stopping", "stopped")]
    assert "while it was starting" in deployment.events.last().message


@pytest.mark.llama
def test_a_stop_that_read_starting_while_the_engine_was_recorded_still_stops_it(engines, model_root, tiny_model,
                                                                                monkeypatch):
    deployment, replica = deploy(model_root, tiny_model)
    starting = in_thread(node_agent.start_replica, str(replica.public_id))
    assert engines.launched.wait(60), "the engine was never launched"
    real_move = states.move
    stop_thread = threading.current_thread()

    def move_after_the_start_recorded_its_engine(subject, to, *args, **kwargs):
        # The stop has read "starting"; before its move lands, the start records "loading".
        if to == "stopping" and threading.current_thread() is stop_thread and not engines.go_on.is_set():
            engines.go_on.set()
            wait_until(lambda: Replica.objects.filter(pk=subject.pk, state="loading").exists(), 60,
                       what="the start recorded its engine")
        return real_move(subject, to, *args, **kwargs)

    real_watch = node_agent.watch_startup

    def watch_once_the_stop_landed(subject, **kwargs):
        # The engine (a tiny model) could be ready before the stop lands; the race is about a
        # replica still loading, so its start-up watch waits for the stop's move first.
        wait_until(lambda: Replica.objects.filter(pk=subject.pk).exclude(state="loading").exists(), 60,
                   what="the stop moved the loading replica")
        return real_watch(subject, **kwargs)

    monkeypatch.setattr(states, "move", move_after_the_start_recorded_its_engine)
    monkeypatch.setattr(node_agent, "watch_startup", watch_once_the_stop_landed)
    service.stop(ADMIN, deployment)
    node_agent.stop_replica(str(replica.public_id))
    starting.join(60)
    assert not starting.is_alive()
    deployment.refresh_from_db()
    assert deployment.state == "stopped", transitions(deployment)
    assert_gone(engines.pids[0])
    assert_nothing_held(replica)
    assert transitions(deployment) == [("planned", "starting"), ("starting", "loading"), ("loading", "stopping"),
                                       ("stopping", "stopped")]


@pytest.mark.llama
def test_an_agent_restarting_after_a_stop_mid_start_stops_the_engine_it_had_launched(engines, model_root,
                                                                                     tiny_model, node):
    deployment, replica = deploy(model_root, tiny_model)
    starting = in_thread(node_agent.start_replica, str(replica.public_id))
    assert engines.launched.wait(60), "the engine was never launched"
    (pid,) = engines.pids
    service.stop(ADMIN, deployment)
    node_agent.stop_replica(str(replica.public_id))
    # The agent dies here: its start never records the engine nor finishes the stop. A new agent
    # (a fresh runtime, which finds the engine by its pidfile) adopts what it left.
    node_runtime._runtimes["process"] = ProcessRuntime(engines.real.state_dir)
    adopt.adopt(node)
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert_gone(pid)
    assert_nothing_held(replica)
    assert transitions(deployment)[-2:] == [("starting", "stopping"), ("stopping", "stopped")]
    engines.go_on.set()  # the dead agent's start, for the test's sake: it finds nothing left to do
    starting.join(60)
    assert transitions(deployment)[-1] == ("stopping", "stopped") and len(transitions(deployment)) == 3


@pytest.mark.llama
def test_a_real_agent_handling_a_start_after_the_stop_starts_nothing(agent, model_root, tiny_model, monkeypatch):
    from serving import tasks

    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)  # held back, sent below
    deployment, replica = deploy(model_root, tiny_model)
    assert service.stop(ADMIN, deployment).state == "stopped"
    job = tasks.start_replica.apply_async(args=[str(replica.public_id)], queue=f"node.{NODE}")
    wait_until(lambda: f"start_replica[{job.id}] succeeded" in agent.log_path.read_text(), 60,
               what="the agent handled the start")
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert transitions(deployment) == [("planned", "stopped")]
    assert not ProcessRuntime(agent.log_path.parent / "engines").managed()
