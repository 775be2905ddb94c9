"""Sleep and wake: vLLM's HTTP contract (served on loopback: no GPU here), the memory freed and
claimed back, llama.cpp's plain refusal, and a wake taking its turn at the start-up gate like a
start: behind engines starting, in the same first-come-first-served line as queued starts.

Sleep and wake are node jobs: the control plane claims the memory and the start-up slot when the
node claims a wake, and records what the node reports; the agent asks vLLM. Most tests play the
agent in this process (``tests/assets/node_inline.py``); the last ones run a real agent."""

import copy
import shutil
import threading
from datetime import timedelta
from urllib.parse import urlparse

import pytest
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from scheduler.models import MemoryReservation
from scheduler.services import NodeReport, register_node
from serving import queues
from serving.deployments import gate, service
from serving.deployments.service import holder_of
from serving.errors import SleepNotSupported
from serving.keys import replica_key
from serving.control import node_work
from serving.models import Deployment, NodeJob, Replica
from serving.node import lifecycle
from tenancy.audit import Actor
from tests.assets.llama_server import free_port
from tests.assets.node_inline import InlineClient, claim, run_next
from tests.assets.vllm_contract import ContractServer
from tests.assets.waiting import wait_until

pytestmark = pytest.mark.django_db
GIB = 2**30
MIB = 2**20
ADMIN = Actor(system="tests")
ask = queues.to_node  # the real one, for the tests' own asks (``sent`` keeps only the code's dispatches)


@pytest.fixture
def contract():
    server = ContractServer()
    yield server
    server.close()


@pytest.fixture
def second_contract():
    server = ContractServer()
    yield server
    server.close()


@pytest.fixture
def replica(contract):
    node = register_node(NodeReport(name="gpu-box", address="127.0.0.1", cpu_count=8,
                                    memory_total_bytes=64 * GIB, memory_available_bytes=40 * GIB))
    deployment = Deployment.objects.create(name="big", engine="vllm", model_path="/models/big", node=node,
                                           memory_reserved_bytes=4 * GIB, state="ready")
    made = Replica.objects.create(deployment=deployment, node=node, port=urlparse(contract.base_url).port,
                                  state="ready", memory_reserved_bytes=4 * GIB)
    MemoryReservation.objects.create(node=node, holder=holder_of(made), bytes=4 * GIB)
    return made


@pytest.fixture
def node_agent(replica, monkeypatch):
    """The replica's node's agent, played in this process; its machine has 40 GiB free (what the
    agent reads before it wakes an engine into its memory)."""
    monkeypatch.setattr(lifecycle, "meminfo", lambda: {"MemTotal": 64 * GIB, "MemAvailable": 40 * GIB})
    return InlineClient(replica.node)


def sleep(node_agent, replica) -> lifecycle.Job | None:
    """Ask the node to put ``replica`` to sleep, and let its agent do it."""
    ask("sleep", replica)
    return run_next(node_agent, "sleep")


def wake(node_agent, replica) -> lifecycle.Job | None:
    """Ask the node to wake ``replica``, and let its agent claim the job (None: nothing was handed
    out, the wake refused or waiting its turn) and do it."""
    ask("wake", replica)
    return run_next(node_agent, "wake")


def test_sleep_frees_the_memory_and_wake_claims_it_back(contract, replica, node_agent):
    assert sleep(node_agent, replica) is not None
    replica.refresh_from_db()
    assert replica.state == "sleeping" and replica.deployment.__class__.objects.get().state == "sleeping"
    assert not MemoryReservation.objects.exists()
    assert wake(node_agent, replica) is not None
    replica.refresh_from_db()
    assert replica.state == "ready"
    assert MemoryReservation.objects.get().bytes == 4 * GIB
    assert [(c["method"], c["path"]) for c in contract.calls] == [("POST", "/sleep"), ("POST", "/wake_up")]
    assert contract.calls[0]["query"] == {"level": ["1"]}
    assert {c["authorization"] for c in contract.calls} == {f"Bearer {replica_key(replica.public_id)}"}
    jobs = NodeJob.objects.order_by("created_at", "pk").values_list("kind", "state")
    assert list(jobs) == [("sleep", "done"), ("wake", "done")]


def test_wake_is_refused_while_the_memory_is_taken(contract, replica, node_agent):
    sleep(node_agent, replica)
    node = replica.node
    node.memory_available_bytes = 2 * GIB  # someone else took the memory meanwhile
    node.save(update_fields=["memory_available_bytes"])
    assert wake(node_agent, replica) is None  # refused at its claim: the node is handed nothing to do
    replica.refresh_from_db()
    assert replica.state == "sleeping"
    assert "wake refused" in replica.events.order_by("-at", "-id").first().message
    assert ("POST", "/wake_up") not in [(c["method"], c["path"]) for c in contract.calls]
    assert not MemoryReservation.objects.exists()


def test_llama_cpp_cannot_sleep(db):
    node = register_node(NodeReport(name="cpu", address="127.0.0.1"))
    deployment = Deployment.objects.create(name="small", engine="llamacpp", model_path="/m.gguf", node=node,
                                           state="ready")
    with pytest.raises(SleepNotSupported, match="cannot sleep: stop small"):
        service.sleep(ADMIN, deployment)


# --- the start-up gate ---------------------------------------------------------------------------

def starting_engine(node, name="loader") -> Replica:
    """A replica loading on ``node``: it holds one of the node's start-up slots until it is stopped."""
    deployment = Deployment.objects.create(name=name, engine="llamacpp", model_path=f"/models/{name}.gguf", node=node,
                                           state="loading")
    return Replica.objects.create(deployment=deployment, node=node, port=free_port(), state="loading")


def asleep(node, contract, name="big", reserved=64 * MIB, owner=None) -> Replica:
    """A sleeping vLLM replica on ``node``, its engine the stand-in; asleep, it holds no memory."""
    deployment = Deployment.objects.create(name=name, engine="vllm", model_path=f"/models/{name}", node=node,
                                           memory_reserved_bytes=reserved, state="sleeping", owner=owner)
    return Replica.objects.create(deployment=deployment, node=node, port=urlparse(contract.base_url).port,
                                  state="sleeping", memory_reserved_bytes=reserved)


def hold_wake_ups(contract) -> tuple[threading.Event, threading.Event]:
    """From now on the stand-in answers /wake_up only once ``go_on`` is set; ``arrived`` says one came."""
    arrived, go_on = threading.Event(), threading.Event()
    answer = contract.httpd.RequestHandlerClass

    class Held(answer):
        def do_POST(self):
            if urlparse(self.path).path == "/wake_up":
                arrived.set()
                go_on.wait(60)
            super().do_POST()

    contract.httpd.RequestHandlerClass = Held
    return arrived, go_on


@pytest.fixture
def sent(monkeypatch):
    """The jobs the code queues for nodes, kept (and queued: this process plays the agent)."""
    kept: list[tuple[str, str]] = []

    def to_node(kind, replica, payload=None):
        kept.append((kind, str(replica.public_id)))
        return ask(kind, replica, payload)

    monkeypatch.setattr(queues, "to_node", to_node)
    return kept


def test_a_wake_with_every_slot_taken_claims_its_memory_and_waits_its_turn(contract, replica, node_agent, sent):
    sleep(node_agent, replica)
    loader = starting_engine(replica.node)
    assert wake(node_agent, replica) is None  # its claim put it in line: nothing for the node to do yet
    replica.refresh_from_db()
    assert replica.state == "sleeping" and replica.wake_requested_at and replica.waking_since is None
    assert MemoryReservation.objects.get(holder=holder_of(replica)).bytes == 4 * GIB  # claimed before it waits
    assert ("POST", "/wake_up") not in [(c["method"], c["path"]) for c in contract.calls]
    assert gate.position(replica) == 1
    assert replica.events.last().message.startswith("wake waits for a start-up slot on gpu-box (position 1; 1 starting")
    node_work.admit_next(replica.node_id)  # the slot is still taken: nobody is sent
    assert sent == []
    Replica.objects.filter(pk=loader.pk).update(state="stopped")
    node_work.admit_next(replica.node_id)  # the slot freed: the wake is next in line
    assert sent == [("wake", str(replica.public_id))]
    assert run_next(node_agent, "wake") is not None  # the node claims the wake queued at its turn, and does it
    replica.refresh_from_db()
    assert replica.state == "ready" and replica.wake_requested_at is None and replica.waking_since is None
    assert MemoryReservation.objects.get(holder=holder_of(replica)).bytes == 4 * GIB


def test_queued_starts_and_waiting_wakes_share_one_line_first_come_first_served(contract, replica, node_agent, sent):
    sleep(node_agent, replica)
    node = replica.node
    starting_engine(node)
    queued = starting_engine(node, "early")
    Replica.objects.filter(pk=queued.pk).update(state="queued", queued_at=replica.created_at)
    queued.refresh_from_db()
    wake(node_agent, replica)  # asked after ``early`` queued: behind it
    replica.refresh_from_db()
    assert (gate.position(queued), gate.position(replica)) == (1, 2)
    assert gate.next_in_line(node.pk) == queued
    Replica.objects.filter(pk=queued.pk).update(queued_at=replica.wake_requested_at + timedelta(seconds=1))
    queued.refresh_from_db()
    assert (gate.position(replica), gate.position(queued)) == (1, 2)
    assert gate.next_in_line(node.pk) == replica
    queued.state = "planned"  # a start that has not queued yet finds the wake ahead of it
    assert not gate.claim(queued) and Replica.objects.get(pk=queued.pk).state == "queued"


@pytest.mark.django_db(transaction=True)
def test_a_start_finds_a_waking_replica_holding_a_slot(contract, replica, node_agent, sent):
    sleep(node_agent, replica)
    arrived, go_on = hold_wake_ups(contract)
    ask("wake", replica)
    job = claim(node_agent)  # the wake takes its slot at its claim
    assert job is not None and job.kind == "wake"
    job.client = copy.copy(job.client)
    job.client._http = Client()  # the worker's own test client: the main thread uses the other

    def wake():  # an agent worker thread, with its own database connection
        try:
            lifecycle.run(job, replica.node.name)
        finally:
            connection.close()

    waking = threading.Thread(target=wake)
    waking.start()
    try:
        assert arrived.wait(30), "the wake never reached the engine"
        assert gate.busy(replica.node_id) == 1
        start = starting_engine(replica.node, "next")
        Replica.objects.filter(pk=start.pk).update(state="planned")
        start.refresh_from_db()
        assert not gate.claim(start)
        start.refresh_from_db()
        assert start.state == "queued"
    finally:
        go_on.set()
        waking.join(30)
    assert not waking.is_alive(), "the wake never ended"
    replica.refresh_from_db()
    assert replica.state == "ready"
    assert sent == [("start", str(start.public_id))]  # the wake handed its slot to the start


def test_a_wake_that_waited_past_its_timeout_gives_up_and_stays_asleep(contract, replica, node_agent, sent, settings):
    sleep(node_agent, replica)
    starting_engine(replica.node)
    assert wake(node_agent, replica) is None  # in line, its memory claimed
    assert MemoryReservation.objects.filter(holder=holder_of(replica)).exists()
    # Its deadline passes: the row says when it was asked, so that moves back rather than the test waiting.
    waited = timedelta(seconds=settings.SERVING_WAKE_TIMEOUT_SECONDS + 1)
    Replica.objects.filter(pk=replica.pk).update(wake_requested_at=replica.created_at - waited)
    node_work.admit_next(replica.node_id)  # what the heartbeat does every beat
    replica.refresh_from_db()
    assert replica.state == "sleeping" and replica.wake_requested_at is None
    assert not MemoryReservation.objects.exists()
    assert replica.events.last().message == \
        f"wake given up: no start-up slot came within {settings.SERVING_WAKE_TIMEOUT_SECONDS}s of being asked"
    assert gate.position(replica) is None and sent == []


def test_the_console_says_where_a_queued_wake_stands(contract, replica, node_agent, sent, personas, client,
                                                     settings):
    settings.SERVING_WAKE_WAIT_SECONDS = 0  # nobody plays the agent here: the request answers at once
    sleep(node_agent, replica)
    Deployment.objects.filter(pk=replica.deployment_id).update(owner=personas.acme.team)
    starting_engine(replica.node, "early")
    Replica.objects.filter(deployment__name="early").update(state="queued", queued_at=replica.created_at)
    client.force_login(personas.max)
    answer = client.post(f"/models/deployments/{replica.deployment.public_id}/wake/", follow=True)
    assert answer.status_code == 200
    assert "big waits for a start-up slot (position 2) and wakes at its turn." in answer.content.decode()
    assert sent == [("wake", str(replica.public_id))]
    client.force_login(personas.oscar)  # an outsider cannot wake it
    assert client.post(f"/models/deployments/{replica.deployment.public_id}/wake/").status_code == 404


# --- against the real agent ------------------------------------------------------------------------

def calls_to(contract, path: str) -> int:
    return sum(1 for c in contract.calls if c["path"] == path)


@pytest.mark.django_db(transaction=True)
def test_a_wake_behind_a_starting_engine_answers_202_with_its_place_then_wakes(agent, node, contract, second_contract,
                                                                                personas, settings):
    settings.SERVING_WAKE_WAIT_SECONDS = 1  # the request's wait; the agent has one start-up slot
    loader = starting_engine(node)
    first = asleep(node, contract, "big", owner=personas.acme.team)
    second = asleep(node, second_contract, "bigger", owner=personas.acme.team)
    caller = APIClient()
    caller.force_login(personas.max)
    answers = [caller.post(f"/api/serving/deployments/{r.deployment.public_id}/wake/") for r in (first, second)]
    assert [a.status_code for a in answers] == [202, 202], [a.content[:300] for a in answers]
    assert [(a.json()["state"], a.json()["queued"], a.json()["position"]) for a in answers] == \
        [("sleeping", True, 1), ("sleeping", True, 2)]
    assert answers[1].json()["replicas"][0]["queue_position"] == 2
    for waiting in (first, second):  # the agent claimed each one's memory, then put it in line
        wait_until(lambda w=waiting: w.events.filter(message__startswith="wake waits").exists(), 30,
                   what="the agent queued the wake")
        assert MemoryReservation.objects.filter(holder=holder_of(waiting)).exists()
    assert calls_to(contract, "/wake_up") + calls_to(second_contract, "/wake_up") == 0
    service.stop(ADMIN, loader.deployment)  # the engine starting frees its slot
    wait_until(lambda: Replica.objects.filter(pk__in=[first.pk, second.pk], state="ready").count() == 2, 60,
               what="both woke")
    assert calls_to(contract, "/wake_up") == calls_to(second_contract, "/wake_up") == 1
    woke = [Replica.objects.get(pk=r.pk).ready_at for r in (first, second)]
    assert Replica.objects.get(pk=loader.pk).stopped_at < woke[0] < woke[1]  # in turn, in their order
    answer = caller.get(f"/api/serving/deployments/{first.deployment.public_id}/")
    assert answer.json()["state"] == "ready"


@pytest.mark.django_db(transaction=True)
def test_a_wake_whose_memory_is_not_free_is_refused_at_once_and_stays_asleep(agent, node, contract, personas,
                                                                            settings):
    settings.SERVING_WAKE_WAIT_SECONDS = 30
    starting_engine(node)  # the memory is checked before the wake takes its place in line
    replica = asleep(node, contract, reserved=2**50, owner=personas.acme.team)  # more than any machine has
    caller = APIClient()
    caller.force_login(personas.max)
    answer = caller.post(f"/api/serving/deployments/{replica.deployment.public_id}/wake/")
    assert answer.status_code == 409, answer.content[:300]
    error = answer.json()["error"]
    assert error["code"] == "insufficient_memory_to_wake"
    assert error["message"].startswith("big stays asleep: wake refused: Not enough memory")
    replica.refresh_from_db()
    assert replica.state == "sleeping" and replica.wake_requested_at is None
    assert not MemoryReservation.objects.filter(holder=holder_of(replica)).exists()
    assert calls_to(contract, "/wake_up") == 0


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_start_queued_behind_a_waking_replica_waits_for_it(agent, node, contract, model_root, tiny_model):
    replica = asleep(node, contract)
    arrived, go_on = hold_wake_ups(contract)
    try:
        assert service.wake(ADMIN, replica.deployment, wait_seconds=0).state == "sleeping"
        assert arrived.wait(30), "the wake never reached the engine"  # it holds the node's one slot now
        path = shutil.copy(tiny_model, model_root / "tiny.gguf")
        started = service.deploy(ADMIN, service.DeployRequest(name="tiny", model_path=str(path), node=node,
                                                               config={"context": 256})).replica_set.get()
        wait_until(lambda: Replica.objects.filter(pk=started.pk, state="queued").exists(), 30,
                   what="the start queued")
        assert "1 starting or waking" in started.events.last().message
    finally:
        go_on.set()
    wait_until(lambda: Replica.objects.filter(pk=started.pk, state="ready").exists(), 120, what="the start went on")
    replica.refresh_from_db()
    assert replica.state == "ready"
    admitted = started.events.get(from_state="queued", to_state="starting")
    assert replica.events.get(to_state="ready").at <= admitted.at  # the slot came from the wake
