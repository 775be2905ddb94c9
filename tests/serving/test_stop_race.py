"""A stop that races a start: the deployment ends stopped, no engine is left running, and the
events tell what happened.

The node's agent is played in this process (``tests/assets/node_inline.py``): its jobs are claimed
and done by the real agent code, in the order each race needs (the agent itself runs them on a
thread pool, so two of them do interleave like this); the engines are real llama-server
processes, checked by PID. One test replays the race on a real agent."""

from __future__ import annotations

import copy
import os
import shutil
import threading
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from scheduler.models import MemoryReservation, Node
from serving import queues
from serving.deployments import gate, service, states
from serving.models import Deployment, NodeJob, Replica
from serving.node import lifecycle, runtime as node_runtime
from serving.node.client import NodeApiError
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets.agent import NODE
from tests.assets.node_inline import InlineClient, beat, claim, run_next
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
    """This process as the node's agent: its own engines directory, its jobs claimed when the test
    says (``engines.client``); every engine it launched is stopped after."""
    settings.SERVING_DRAIN_SECONDS = 0  # a stop job is handed out at once: nothing routes to these engines
    runtime = PausingRuntime(ProcessRuntime(tmp_path / "engines"))
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": runtime})
    runtime.client = InlineClient(node)
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


def jobs_of(replica: Replica) -> list[tuple[str, str]]:
    return list(NodeJob.objects.filter(replica=replica).order_by("created_at", "pk").values_list("kind", "state"))


class Worker:
    """An agent worker thread doing one claimed job (its own database connection, closed when it
    ends, and its own test client: the main thread goes on claiming through the other). What the
    job raised is kept in ``error``."""

    def __init__(self, job: lifecycle.Job):
        job.client = copy.copy(job.client)
        job.client._http = Client()
        self.job = job
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        try:
            lifecycle.run(self.job, NODE)
        except BaseException as error:  # noqa: BLE001 - kept for the test to assert on
            self.error = error
        finally:
            connection.close()

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive(), f"the {self.job} never ended"


def start_in_thread(engines: PausingRuntime, replica: Replica) -> Worker:
    """Claim the replica's start job and do it on a worker thread."""
    job = claim(engines.client)
    assert job is not None and job.kind == "start" and job.payload["replica"] == str(replica.public_id)
    return Worker(job)


def transitions(deployment: Deployment) -> list[tuple[str, str]]:
    return list(deployment.events.order_by("at", "id").values_list("from_state", "to_state"))


def assert_gone(pid: int) -> None:
    """The engine's process has exited: no such PID, or one left a zombie until this process (its
    parent, standing in for the agent that launched it) reaps it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return
    assert state == "Z", f"engine process {pid} still runs (state {state})"


def assert_nothing_held(replica: Replica) -> None:
    holder = service.holder_of(replica)
    assert not MemoryReservation.objects.filter(holder__startswith=holder).exists()


def test_a_deploy_stopped_before_its_agent_handles_the_start_never_starts(engines, model_root, tiny_model):
    engines.go_on.set()  # nothing to hold back: no engine may be launched at all
    deployment, replica = deploy(model_root, tiny_model)
    assert jobs_of(replica) == [("start", "queued")]  # queued on commit, not yet claimed
    assert service.stop(ADMIN, deployment).state == "stopped"
    assert claim(engines.client) is None  # the start job, claimed after the stop, is moot: nothing is handed out
    assert jobs_of(replica) == [("start", "cancelled")]
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
    starting = start_in_thread(engines, replica)
    assert engines.launched.wait(60), "the engine was never launched"
    (pid,) = engines.pids
    service.stop(ADMIN, deployment)
    # Only the start knows the engine it launched: the stop is recorded, no stop job is asked of
    # the node, and nothing claims the replica stopped.
    assert claim(engines.client) is None
    assert [kind for kind, _ in jobs_of(replica)] == ["start"]
    replica.refresh_from_db()
    assert replica.state == "stopping"
    os.kill(pid, 0)  # still running, and the row does not say stopped
    engines.go_on.set()
    starting.join()
    assert starting.error is None
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert_gone(pid)
    assert_nothing_held(replica)
    assert transitions(deployment) == [("planned", "starting"), ("starting", "stopping"), ("stopping", "stopped")]
    assert "while it was starting" in deployment.events.last().message
    assert jobs_of(replica) == [("start", "done")]
    assert NodeJob.objects.get(replica=replica).result["outcome"] == "stopped"


@pytest.mark.llama
def test_a_stop_that_read_starting_while_the_engine_was_recorded_still_stops_it(engines, model_root, tiny_model,
                                                                                monkeypatch):
    deployment, replica = deploy(model_root, tiny_model)
    starting = start_in_thread(engines, replica)
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

    real_watch = lifecycle._watch

    def watch_once_the_stop_landed(job, launch, handle, **kwargs):
        # The engine (a tiny model) could be ready before the stop lands; the race is about a
        # replica still loading, so its start-up watch waits for the stop's move first.
        wait_until(lambda: Replica.objects.filter(pk=replica.pk).exclude(state="loading").exists(), 60,
                   what="the stop moved the loading replica")
        return real_watch(job, launch, handle, **kwargs)

    monkeypatch.setattr(states, "move", move_after_the_start_recorded_its_engine)
    monkeypatch.setattr(lifecycle, "_watch", watch_once_the_stop_landed)
    service.stop(ADMIN, deployment)  # its stop read "starting", and found "loading" when it moved
    replica.refresh_from_db()
    assert replica.state == "stopping" and replica.handle["pid"] == engines.pids[0]
    starting.join()  # the watch hears the replica is no longer to load (or sees it ready): it leaves it
    assert starting.error is None
    run_next(engines.client, "stop")  # the stop's own job stops the engine the start recorded
    deployment.refresh_from_db()
    assert deployment.state == "stopped", list(deployment.events.values_list("to_state", "message"))
    assert_gone(engines.pids[0])
    assert_nothing_held(replica)
    assert transitions(deployment) == [("planned", "starting"), ("starting", "loading"), ("loading", "stopping"),
                                       ("stopping", "stopped")]


@pytest.mark.llama
def test_an_agent_restarting_after_a_stop_mid_start_stops_the_engine_it_had_launched(engines, model_root,
                                                                                     tiny_model, node):
    deployment, replica = deploy(model_root, tiny_model)
    starting = start_in_thread(engines, replica)
    assert engines.launched.wait(60), "the engine was never launched"
    (pid,) = engines.pids
    service.stop(ADMIN, deployment)
    # The agent dies here: its start never reports the engine nor finishes the stop. A new agent
    # (a fresh runtime, which finds the engine by its pidfile) says what runs at its first beat,
    # and the control plane adopts what the dead one left: the engine is stopped.
    node_runtime._runtimes["process"] = ProcessRuntime(engines.real.state_dir)
    beat(engines.client, first=True)
    run_next(engines.client, "stop")
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert_gone(pid)
    assert_nothing_held(replica)
    assert transitions(deployment)[-2:] == [("starting", "stopping"), ("stopping", "stopped")]
    assert claim(engines.client) is None  # the dead agent's start, queued again at the beat, is moot now
    engines.go_on.set()  # the dead agent's start, for the test's sake: its lease is no longer the job's
    starting.join()
    assert isinstance(starting.error, NodeApiError) and starting.error.code == "node_lease_stale"
    assert transitions(deployment)[-1] == ("stopping", "stopped") and len(transitions(deployment)) == 3


@pytest.mark.llama
def test_a_real_agent_handling_a_start_after_the_stop_starts_nothing(agent, model_root, tiny_model, monkeypatch):
    real_to_node = queues.to_node
    monkeypatch.setattr(queues, "to_node", lambda kind, replica, payload=None: None)  # held back, queued below
    deployment, replica = deploy(model_root, tiny_model)
    assert service.stop(ADMIN, deployment).state == "stopped"
    job = real_to_node("start", replica)
    wait_until(lambda: NodeJob.objects.filter(pk=job.pk).exclude(state="queued").exists(), 60,
               what="the agent claimed the start")
    job.refresh_from_db()
    assert job.state == "cancelled"  # moot at its claim: the agent was handed nothing to start
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert transitions(deployment) == [("planned", "stopped")]
    assert not ProcessRuntime(agent.log_path.parent / "engines").managed()
