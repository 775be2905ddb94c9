"""Serving applies Scheduler II's plans for the catalog's models: launches to meet the scaling
minimum, surplus evicted, a fixed point once converged, what the catalog does not know untouched;
replicas the gateway reports busy kept, load scaling, and room made for an on-demand load."""

import dataclasses
import shutil
import time
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from scheduler.models import PlacementDecision
from scheduler.services import register_node
from serving import queues
from serving import load
from serving.control import ondemand
from serving.catalog import room
from serving.catalog.entries import import_local
from serving.models import ModelEntry
from serving.deployments import gate, service
from serving.control import placement
from serving.node.discovery import local_node_report
from serving.models import Deployment, Replica
from serving.control.ondemand import request_load
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db
ACTOR = Actor(system="tests")


@pytest.fixture(autouse=True)
def nothing_remembered():
    cache.clear()  # scaling states, holds, last uses and logged reasons of earlier tests must not count here


@pytest.fixture
def setup(tmp_path, settings, tiny_model, monkeypatch):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    node = register_node(dataclasses.replace(local_node_report(), name="place-node"))
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.deployment.name)))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "t.gguf"), name="placed")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1,
                                                  profiles=[{**entry.profiles[0], "context": 256}])
    return node, sent


def serving_count(name="placed") -> int:
    return Replica.objects.filter(deployment__name=name).exclude(state__in=("stopped", "failed")).count()


def test_the_minimum_is_launched_once_and_recorded_as_evidence(setup, django_capture_on_commit_callbacks):
    node, sent = setup
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["launched"] == ["placed"]
    deployment = Deployment.objects.get(name="placed")
    assert deployment.node == node and sent == [("start", "placed")]
    assert PlacementDecision.objects.filter(model="placed").exists()
    assert placement.reconcile() == {"launched": [], "evicted": [], "unschedulable": {}}  # converged: a fixed point
    assert serving_count() == 1


def test_a_higher_minimum_adds_a_replica_and_a_lower_maximum_evicts_the_surplus(
        setup, django_capture_on_commit_callbacks):
    _, sent = setup
    placement.reconcile()
    ModelEntry.objects.filter(name="placed").update(scaling_min=2, scaling_max=2)
    assert placement.reconcile()["launched"] == ["placed"]
    assert serving_count() == 2
    Replica.objects.filter(deployment__name="placed").update(state="ready")
    Deployment.objects.filter(name="placed").update(state="ready")
    ModelEntry.objects.filter(name="placed").update(scaling_min=1, scaling_max=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["evicted"] == ["placed"]
    assert sent.count(("stop", "placed")) == 1  # one of the two is asked to stop; its agent stops it


def test_deployments_the_catalog_does_not_know_are_left_alone(setup, tiny_model, tmp_path):
    node, _ = setup
    manual = service.deploy(ACTOR, service.DeployRequest(
        name="by-hand", model_path=str(shutil.copy(tiny_model, tmp_path / "models" / "m.gguf")), node=node,
        config={"context": 256}))
    placement.reconcile()
    placement.reconcile()
    manual.refresh_from_db()
    assert manual.state == "planned" and serving_count("by-hand") == 1


def mark_ready(name, ago=600):
    """The replicas of ``name`` became ready ``ago`` seconds ago (as their agent would record)."""
    now = timezone.now()
    Replica.objects.filter(deployment__name=name).exclude(state__in=("stopped", "failed")).update(
        state="ready", started_at=now - timedelta(seconds=ago + 10), ready_at=now - timedelta(seconds=ago))
    Deployment.objects.filter(name=name).exclude(state__in=("stopped", "failed")).update(state="ready")


def live_ids(name="placed") -> list[str]:
    return [str(r) for r in Replica.objects.filter(deployment__name=name).exclude(state__in=("stopped", "failed"))
            .values_list("public_id", flat=True)]


@pytest.fixture
def gateway_reports():
    """Publish load as a gateway process would; withdrawn after the test."""
    yield lambda in_flight=None, waiting=None: load.publish("test-gateway", in_flight or {}, waiting or {})
    load.withdraw("test-gateway")


def test_replicas_with_requests_in_flight_are_not_evicted(setup, gateway_reports):
    placement.reconcile()
    ModelEntry.objects.filter(name="placed").update(scaling_min=2, scaling_max=2)
    placement.reconcile()
    mark_ready("placed")
    gateway_reports({replica: 1 for replica in live_ids()})  # both are answering requests
    ModelEntry.objects.filter(name="placed").update(scaling_min=1, scaling_max=1)
    assert placement.reconcile()["evicted"] == []
    gateway_reports({})  # the requests finished
    assert placement.reconcile()["evicted"] == ["placed"]


def test_load_held_for_a_minute_adds_a_replica_and_says_why(setup, gateway_reports, caplog):
    placement.reconcile()
    mark_ready("placed")
    ModelEntry.objects.filter(name="placed").update(scaling_max=2)
    (replica,) = live_ids()
    gateway_reports({replica: 3})  # three in flight on one llama.cpp slot
    assert placement.reconcile()["launched"] == []  # busy, but not yet for a minute
    state = cache.get(placement.SCALE_KEY + "placed")
    assert state["busy_since"] is not None and state["extra"] == 0
    cache.set(placement.SCALE_KEY + "placed", {**state, "busy_since": state["busy_since"] - 61}, None)
    with caplog.at_level("INFO", logger="serving.control.placement"):
        assert placement.reconcile()["launched"] == ["placed"]
    assert "3 in flight" in caplog.text and "one replica added" in caplog.text
    placed = PlacementDecision.objects.filter(model="placed", verdict="placed").values_list("reason_codes", flat=True)
    assert any("load" in codes for codes in placed)  # read here: SQLite has no JSON containment lookup
    assert serving_count() == 2
    seen = sorted((r.created_at, r.load_added) for r in placement.snapshot().replicas if r.model == "placed")
    assert [added for _, added in seen] == [False, True]  # the newer one is the load-added one: it goes first
    assert placement.reconcile()["launched"] == []  # never while another is still starting, never above max


@pytest.fixture
def small_node(tmp_path, settings, tiny_model, monkeypatch):
    """A node with room for one replica of the tiny model, and two on-demand models of it."""
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 0
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.deployment.name)))
    for name in ("old", "new"):
        entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / f"{name}.gguf"), name=name)
        ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=0, scaling_max=1,
                                                      profiles=[{**entry.profiles[0], "context": 256}])
    size = max(p.memory_bytes for p in room.desired_model(ModelEntry.objects.get(name="old")).profiles)
    room_for = int(size * 1.6)
    node = register_node(dataclasses.replace(local_node_report(), name="small-node", memory_total_bytes=room_for,
                                             memory_available_bytes=room_for))
    return node, sent


def test_an_on_demand_load_that_fits_nowhere_stops_an_idle_one_and_starts_once_it_has(
        small_node, django_capture_on_commit_callbacks):
    node, sent = small_node
    request_load("old")
    mark_ready("old")
    load.note_used({"old": time.time() - 300})  # idle for five minutes: it may give way to a load
    (victim,) = live_ids("old")
    with django_capture_on_commit_callbacks(execute=True):
        request_load("new")  # no room as it stands: the policy makes some
    assert ("stop", "old") in sent
    replica = Replica.objects.get(deployment__name="new")
    assert replica.waits_for == [victim] and replica.node == node
    decision = PlacementDecision.objects.get(model="old", verdict="preempted")
    assert decision.victims == [victim] and "gave room to new" in decision.detail
    assert not gate.claim(replica)  # the old engine has not exited yet: it waits, queued
    replica.refresh_from_db()
    assert replica.state == "queued"
    Replica.objects.filter(public_id=victim).update(state="stopped")  # its agent stopped it
    assert gate.claim(replica)
    replica.refresh_from_db()
    assert replica.state == "starting"


def test_a_load_only_batch_requests_wait_for_preempts_nothing_until_an_interactive_one_waits(
        small_node, django_capture_on_commit_callbacks):
    node, sent = small_node
    request_load("old")
    mark_ready("old")
    load.note_used({"old": time.time() - 300})  # idle for five minutes: an interactive load may push it out
    with pytest.raises(ondemand.NoIdleRoom, match="waits for free room") as refused:
        request_load("new", batch=True)
    assert refused.value.code == "no_idle_capacity"
    assert "only batch requests wait for it" in refused.value.message
    try:
        load.publish("test-gateway", {}, {"new": 2}, waiting_batch={"new": 2})  # two batch lines wait
        with django_capture_on_commit_callbacks(execute=True):
            assert placement.reconcile()["evicted"] == []
        assert ("stop", "old") not in sent and not Replica.objects.filter(deployment__name="new").exists()
        load.publish("test-gateway", {}, {"new": 3}, waiting_batch={"new": 2})  # and now one interactive request
        with django_capture_on_commit_callbacks(execute=True):
            assert placement.reconcile()["evicted"] == ["old"]
        assert ("stop", "old") in sent and Replica.objects.filter(deployment__name="new").exists()
    finally:
        load.withdraw("test-gateway")


def test_a_parked_model_is_not_placed_until_its_definition_changes(setup):
    from scheduler import recovery_service
    from scheduler.models import RecoveryState

    fingerprint = ModelEntry.objects.get(name="placed").fingerprint
    for _ in range(5):
        recovery_service.note_failure("placed", "crash", "engine exited with status 1 while loading", fingerprint)
    assert placement.reconcile()["launched"] == []
    assert PlacementDecision.objects.filter(model="placed", verdict="parked").exists()
    ModelEntry.objects.filter(name="placed").update(fingerprint="a-new-definition")
    assert placement.reconcile()["launched"] == ["placed"]
    assert not RecoveryState.objects.get(model="placed").parked  # the parked list stops showing it


def test_an_unplaceable_model_is_logged_once_until_its_reason_changes(setup, settings, caplog):
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 0
    size = max(p.memory_bytes for p in room.desired_model(ModelEntry.objects.get(name="placed")).profiles)
    register_node(dataclasses.replace(local_node_report(), name="place-node", memory_total_bytes=int(size * 1.6),
                                      memory_available_bytes=int(size * 1.6)))  # room for one replica
    ModelEntry.objects.filter(name="placed").update(scaling_min=3, scaling_max=3)
    with caplog.at_level("WARNING", logger="serving.control.placement"):
        placement.reconcile()
        placement.reconcile()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot place placed")]
    assert len(said) == 1 and "missing" in said[0]


def test_a_tensor_parallel_replica_holds_a_shard_on_each_of_its_accelerators(tmp_path, settings, tiny_model,
                                                                             monkeypatch):
    from scheduler.memory import release_reservation
    from scheduler.models import MemoryReservation
    from scheduler.nvml import discover_gpus
    from scheduler.services import EngineReport, NodeReport
    from tests.assets.recorded_nvml import RecordedNvml, recorded_smi

    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)
    register_node(NodeReport(name="h100-01", address="127.0.0.1", cpu_count=128, memory_total_bytes=2048 * 2**30,
                             memory_available_bytes=1900 * 2**30, engines=(EngineReport(kind="llamacpp", version="b1"),),
                             gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "tp.gguf"), name="tp")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1,
                                                  profiles=[{**entry.profiles[0], "gpus": 2, "context": 256}])
    assert placement.reconcile()["launched"] == ["tp"]
    deployment = Deployment.objects.get(name="tp")
    replica = deployment.replica_set.get()
    shards = list(MemoryReservation.objects.filter(holder__startswith=service.holder_of(replica)).order_by("holder"))
    assert [r.holder for r in shards] == [service.holder_of(replica), service.holder_of(replica) + "#1"]
    assert len(deployment.gpu_uuids) == 2 and {r.accelerator.uuid for r in shards} == set(deployment.gpu_uuids)
    # Each GPU holds its run of the layers (llama.cpp splits them), not the whole model.
    from scheduler import memory

    whole_on_one = memory.estimate_and_fit(deployment.model_path, "llamacpp", {"ctx_size": 256, "n_gpu_layers": -1})
    assert deployment.estimate["device"] == "gpu" and deployment.estimate["inputs"]["split_gpus"] == 2
    assert all(r.bytes == deployment.memory_reserved_bytes < whole_on_one.estimate.total_bytes for r in shards)
    [seen] = [r for r in placement.snapshot().replicas if r.model == "tp"]
    assert len(seen.accelerators) == 2 and not any(r.id.startswith("reservation:") for r in placement.snapshot().replicas)
    assert placement.reconcile()["launched"] == []  # a fixed point: the two shards are one replica
    release_reservation(service.holder_of(replica))
    assert not MemoryReservation.objects.exists()


def test_a_degraded_relaunch_halves_the_context_and_offloads_fewer_layers(tmp_path, settings, tiny_model):
    from scheduler.estimation.reading import read_model
    from scheduler.models import Accelerator
    from scheduler.nvml import discover_gpus
    from scheduler.services import NodeReport
    from serving.control.placement import deploy_request
    from tests.assets.recorded_nvml import RecordedNvml, recorded_smi

    settings.SCHEDULER_MODEL_ROOTS = [tmp_path.resolve()]
    node = register_node(NodeReport(name="h100-01", address="127.0.0.1", memory_total_bytes=2048 * 2**30,
                                    gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "d.gguf"), name="d")
    ModelEntry.objects.filter(pk=entry.pk).update(profiles=[{**entry.profiles[0], "context": 2048}])
    entry.refresh_from_db()
    assert deploy_request(entry, node).config["context"] == 2048
    degraded = deploy_request(entry, node, level=1).config
    assert degraded["context"] == 1024 and "gpu_layers" not in degraded  # on the CPU: the context only
    gpu = Accelerator.objects.filter(node=node).first()
    layers = read_model(tmp_path / "d.gguf").layers
    degraded = deploy_request(entry, node, accelerator=gpu, level=1).config
    assert degraded["context"] == 1024 and degraded["gpu_layers"] == layers * 3 // 4


def test_one_pass_at_a_time(setup):
    import threading

    cache.add(placement.LOCK_KEY, "another pass", 60)
    assert placement.reconcile()["skipped"] and serving_count() == 0  # the periodic pass just goes
    freed = threading.Timer(0.5, lambda: cache.delete(placement.LOCK_KEY))
    freed.start()
    try:
        assert placement.reconcile(wait_s=20)["launched"] == ["placed"]  # an on-demand load waits its turn
    finally:
        freed.join()
    assert cache.get(placement.LOCK_KEY) is None  # and lets go


def test_a_pinned_on_demand_model_stays_resident_however_idle(setup):
    ModelEntry.objects.filter(name="placed").update(scaling_min=0, pinned=True)
    assert placement.reconcile()["launched"] == ["placed"]  # pinned: one replica even at minimum 0
    mark_ready("placed")
    load.note_used({"placed": time.time() - 10 * 3600})  # idle for hours
    [replica] = [r for r in placement.snapshot().replicas if r.model == "placed"]
    assert replica.pinned
    assert placement.reconcile() == {"launched": [], "evicted": [], "unschedulable": {}}
    ModelEntry.objects.filter(name="placed").update(pinned=False)
    assert placement.reconcile()["evicted"] == ["placed"]  # unpinned, it is an idle on-demand model again



def test_after_the_degraded_relaunch_fails_the_minimal_footprint_runs_once_on_the_cpu_then_the_model_parks(
        tmp_path, settings, tiny_model, monkeypatch):
    """The whole ladder through the loop and the agent's failure path: a GPU model out of memory is
    relaunched degraded on its GPU, then (no fallback) at the minimal footprint on the node's CPU —
    the smallest context, one slot, no layer on a GPU — and parked when that fails too."""
    from scheduler.models import RecoveryState
    from scheduler.nvml import discover_gpus
    from scheduler.services import EngineReport, NodeReport
    from serving.catalog import profiles
    from serving.control import failures
    from serving.runtimes.base import Exit
    from tests.assets.recorded_nvml import RecordedNvml, recorded_smi

    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)
    register_node(NodeReport(name="h100-01", address="127.0.0.1", cpu_count=128, memory_total_bytes=2048 * 2**30,
                             memory_available_bytes=1900 * 2**30,
                             engines=(EngineReport(kind="llamacpp", version="b1"),),
                             gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "big.gguf"), name="big")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1, profiles=[
        {**entry.profiles[0], "gpus": 1, "context": 2048, "parallel": 4}])

    def launch_and_fail(oom=True):
        assert placement.reconcile()["launched"] == ["big"]
        deployment = Deployment.objects.exclude(state="failed").get(name="big")
        replica = deployment.replica_set.get()
        Replica.objects.filter(pk=replica.pk).update(state="loading")
        replica.refresh_from_db()
        failures.record(replica, "engine out of memory while loading" if oom else "engine exited with status 1",
                      exit=Exit(code=137, signal=9, oom_evidence="kernel OOM killer" if oom else None),
                      launch_failure="crash")
        RecoveryState.objects.filter(model="big").update(last_failure_at=timezone.now() - timedelta(hours=1))
        return deployment  # past the backoff: the next pass launches again

    full = launch_and_fail()
    assert full.gpu_uuids and full.config["context"] == 2048 and full.config["parallel"] == 4
    degraded = launch_and_fail()
    assert degraded.gpu_uuids and degraded.config["context"] == 1024 and degraded.config["gpu_layers"] >= 1
    minimal = launch_and_fail(oom=False)  # the minimal launch fails too, by crashing this time
    assert minimal.gpu_uuids == [] and minimal.estimate["device"] == "cpu"
    assert minimal.config["context"] == profiles.MIN_DEGRADED_CONTEXT and minimal.config["parallel"] == 1
    assert minimal.config["gpu_layers"] == 0
    row = RecoveryState.objects.get(model="big")
    assert row.parked and row.consecutive == 3 and row.last_error == "engine exited with status 1"
    assert placement.reconcile()["launched"] == []  # parked: the ladder is spent
    parked = PlacementDecision.objects.filter(model="big", verdict="parked").latest("created_at")
    assert "engine exited with status 1" in parked.detail


def test_the_minimal_footprint_of_a_vllm_model_stays_on_its_gpu():
    """vLLM cannot run on the CPU: its minimal footprint is the smallest context and one sequence on
    its GPU, with the degraded relaunch's weights offload."""
    from types import SimpleNamespace

    from serving.catalog import profiles

    shape = SimpleNamespace(context_length=32768, layers=32, weights_bytes=16 * 2**30)
    config = profiles.minimal("vllm", {"max_model_len": 8192, "max_num_seqs": 64}, shape, on_gpu=True)
    assert not profiles.runs_on_cpu("vllm") and profiles.runs_on_cpu("llamacpp")
    assert config["max_model_len"] == profiles.MIN_DEGRADED_CONTEXT and config["max_num_seqs"] == 1
    assert config["cpu_offload_gb"] == 4 and "gpu_layers" not in config
