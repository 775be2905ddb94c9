"""Sleep as a residency tier, through the control loop on the database: an idle replica whose engine
can sleep (vLLM), asked for recently, is put to sleep rather than stopped; a request for a model that
only sleeps wakes it through the start-up gate; a waiting request makes the pass wake it where it
sleeps; asleep unasked past the window, it is stopped. The agents' queue is recorded (the engines'
sleep and wake themselves are tests/serving/test_sleep_wake.py's)."""

import shutil
import time

import pytest
from django.core.cache import cache

from scheduler.models import PlacementDecision
from scheduler.nvml import discover_gpus
from scheduler.services import EngineReport, NodeReport, register_node
from serving import load, queues
from serving.catalog.entries import import_local
from serving.control import ondemand, placement
from serving.deployments import states
from serving.models import Deployment, ModelEntry, Replica
from tenancy.audit import Actor
from tests.assets.recorded_nvml import RecordedNvml, recorded_smi

pytestmark = pytest.mark.django_db
ACTOR = Actor(system="tests")
WEIGHTS = 3 * 2**30


@pytest.fixture(autouse=True)
def nothing_remembered():
    cache.clear()


@pytest.fixture
def sleepy(tmp_path, settings, tiny_model, monkeypatch):
    """An on-demand model on an H100 node, loaded once, its engine one that sleeps (vLLM: what the
    deployment row says decides it), ready and idle past its timeout."""
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.pk)))
    register_node(NodeReport(name="h100-01", address="127.0.0.1", cpu_count=128, memory_total_bytes=2048 * 2**30,
                             memory_available_bytes=1900 * 2**30, engines=(EngineReport(kind="llamacpp", version="b1"),),
                             gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "s.gguf"), name="sleepy")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=0, scaling_max=1, idle_timeout_seconds=60,
                                                  profiles=[{**entry.profiles[0], "gpus": 1, "context": 256}])
    assert placement.reconcile(waiting={"sleepy": 1})["launched"] == ["sleepy"]
    replica = Replica.objects.get(deployment__name="sleepy")
    Deployment.objects.filter(pk=replica.deployment_id).update(
        engine="vllm", config={"enable_sleep_mode": True}, estimate={"weights_bytes": WEIGHTS})
    for to in ("starting", "loading", "ready"):
        states.move(replica, to, "as its agent would")
    replica.refresh_from_db()
    return replica, sent


def test_an_idle_replica_asked_for_recently_is_put_to_sleep_not_stopped(sleepy):
    replica, sent = sleepy
    load.note_used({"sleepy": time.time() - 300})  # idle past its 60 s timeout, within the hour's window
    snapshot = placement.snapshot()
    [info] = [r for r in snapshot.replicas if r.model == "sleepy"]
    assert info.sleep_host_bytes == WEIGHTS
    placement.reconcile()
    assert ("sleep", replica.pk) in sent and ("stop", replica.pk) not in sent
    decision = PlacementDecision.objects.filter(model="sleepy", verdict="evicted").latest("created_at")
    assert decision.reason_codes == ["idle", "sleep"] and "put to sleep, not stopped" in decision.detail


def test_asked_for_long_ago_it_is_stopped(sleepy, django_capture_on_commit_callbacks):
    replica, sent = sleepy
    load.note_used({"sleepy": time.time() - 7200})
    with django_capture_on_commit_callbacks(execute=True):
        placement.reconcile()
    assert ("stop", replica.pk) in sent and ("sleep", replica.pk) not in sent


def asleep(replica):
    states.move(replica, "sleeping", "asleep: its device memory is free")  # as its agent records it
    replica.refresh_from_db()
    return replica


def test_a_request_for_a_model_that_only_sleeps_wakes_it_once(sleepy):
    replica, sent = sleepy
    asleep(replica)
    ticket = ondemand.request_load("sleepy")
    assert ticket.expected_seconds == ondemand.WAKE_EXPECTED_S
    assert sent.count(("wake", replica.pk)) == 1
    replica.refresh_from_db()
    assert replica.wake_requested_at is not None  # in line at the start-up gate
    ondemand.request_load("sleepy")  # the next request finds the wake asked for
    assert sent.count(("wake", replica.pk)) == 1


def test_the_pass_wakes_a_sleeping_replica_a_request_waits_for_and_stops_it_past_the_window(sleepy):
    replica, sent = sleepy
    asleep(replica)
    load.note_used({"sleepy": time.time() - 60})
    assert placement.reconcile() == {"launched": [], "evicted": [], "unschedulable": {}}  # nobody waits: it sleeps on
    outcome = placement.reconcile(waiting={"sleepy": 1})
    assert outcome["woken"] == ["sleepy"] and outcome["launched"] == [] and ("wake", replica.pk) in sent
    assert PlacementDecision.objects.filter(model="sleepy", verdict="placed", reason_codes=["wake"]).exists()

    Replica.objects.filter(pk=replica.pk).update(wake_requested_at=None)  # the wake ended, still asleep
    load.note_used({"sleepy": time.time() - 7200})
    assert placement.reconcile()["evicted"] == ["sleepy"]
