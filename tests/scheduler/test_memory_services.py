"""Estimates with calibration records, fits against inventory rows, and the reservation lock."""

import shutil
import threading

import pytest
from django.db import close_old_connections, connection

from scheduler import memory
from scheduler.errors import InsufficientMemory, ModelOutsideRoots, NotPlaceable
from scheduler.estimation.reading import read_model
from scheduler.models import Accelerator, CalibrationRecord, MemoryReservation, Node
from scheduler.policy.calibration import classify_exit
from scheduler.policy.fit import Resident
from tenancy import audit
from tests.assets.waiting import wait_until

GIB = 2**30
MIB = 2**20


@pytest.mark.django_db
def test_estimate_outside_the_model_roots_is_refused(model_root, tmp_path_factory, gguf_model):
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "m.gguf"
    shutil.copy(gguf_model(), elsewhere)
    with pytest.raises(ModelOutsideRoots) as failure:
        memory.estimate_and_fit(elsewhere, "llamacpp")
    assert failure.value.code == "model_outside_roots"


@pytest.mark.django_db
def test_estimate_on_a_cpu_node_fits_against_its_memory(model_root, gguf_model, cpu_node):
    result = memory.estimate_and_fit(gguf_model(), "llamacpp", {"ctx_size": 512}, node=cpu_node)
    assert result.device == "cpu" and result.fit.fits
    assert result.fit.safety_margin_bytes == 8 * GIB
    assert result.fit.outside_bytes == 4 * GIB  # 64 total - 60 available - 0 reserved


@pytest.mark.django_db
def test_calibration_records_change_later_estimates_and_can_be_reset(model_root, gguf_model, cpu_node, admin_user):
    path = gguf_model(layers=4, embedding=256, heads=4, kv_heads=2, context=4096)
    shape = read_model(path)
    first = memory.estimate_and_fit(path, "llamacpp", {"ctx_size": 1024}, node=cpu_node)
    memory.record_load(shape, "llamacpp", "b1", first.config, "cpu", estimated_bytes=first.estimate.total_bytes,
                       measured_bytes=int(first.estimate.total_bytes * 1.5))
    neighbour = memory.estimate_and_fit(path, "llamacpp", {"ctx_size": 4096}, node=cpu_node)
    assert neighbour.estimate.calibration["rule"] == "ratio"
    assert neighbour.estimate.total_bytes == pytest.approx(neighbour.estimate.uncalibrated_total_bytes * 1.5, rel=1e-6)
    other_version = memory.estimate_and_fit(path, "llamacpp", {"ctx_size": 4096}, node=cpu_node, engine_version="b2")
    assert other_version.estimate.calibration is None  # keyed by engine version
    assert memory.reset_calibration(CalibrationRecord.objects.all(), audit.Actor(user=admin_user)) == 1
    again = memory.estimate_and_fit(path, "llamacpp", {"ctx_size": 4096}, node=cpu_node)
    assert again.estimate.calibration is None


@pytest.mark.django_db
def test_only_an_oom_with_evidence_is_recorded(model_root, gguf_model):
    path = gguf_model()
    shape = read_model(path)
    config = memory.engine_config("llamacpp", {"ctx_size": 512})
    tried = memory.raw_estimate(shape, "llamacpp", config).total_bytes
    plain = classify_exit(exit_code=-9)
    assert memory.record_failure(shape, "llamacpp", "b1", config, "cpu", estimated_bytes=tried,
                                 classification=plain) is None
    assert not CalibrationRecord.objects.exists()
    evidence = classify_exit(exit_code=137, docker_oom_killed=True)
    record = memory.record_failure(shape, "llamacpp", "b1", config, "cpu", estimated_bytes=tried,
                                   classification=evidence)
    assert record.outcome == "oom" and "OOMKilled" in record.evidence
    raised = memory.calibrated_estimate(shape, "llamacpp", config, engine_version="b1")
    assert raised.total_bytes == pytest.approx(tried * 1.25, abs=1) and raised.calibration["rule"] == "oom"


@pytest.mark.django_db
def test_vllm_estimate_on_an_h100_sizes_the_pool(model_root, h100_node):
    from tests.scheduler.test_estimation import llama_like, write_hf_model

    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 8192}
    folder = write_hf_model(model_root / "hf-model", config, llama_like())
    gpu = h100_node.accelerators.get(index=3)
    result = memory.estimate_and_fit(folder, "vllm", {"max_num_seqs": 16}, node=h100_node, accelerator=gpu)
    assert result.device == "h100-80g" and result.fit.fits
    assert 0 < result.estimate.vllm["gpu_memory_utilization"] <= 1
    assert result.fit.safety_margin_bytes == gpu.memory_total_bytes * 5 // 100


@pytest.mark.django_db
def test_busy_gpu_counts_memory_used_outside_berth(model_root, h100_node, gguf_model):
    busy = h100_node.accelerators.get(index=0)  # 71 GiB used by something Berth did not start
    result = memory.estimate_and_fit(gguf_model(), "llamacpp", {"n_gpu_layers": -1, "ctx_size": 512},
                                     node=h100_node, accelerator=busy)
    assert result.fit.outside_bytes == busy.memory_used_bytes
    assert result.fit.free_for_new_bytes < 10 * GIB


@pytest.mark.django_db
def test_reservation_refused_with_fit_and_plans(cpu_node):
    memory.reserve_memory(cpu_node, "replica-a", 40 * GIB)
    with pytest.raises(InsufficientMemory) as failure:
        memory.reserve_memory(cpu_node, "replica-b", 20 * GIB,
                              residents=[Resident("replica-a", 40 * GIB, priority=-1)])
    details = failure.value.details
    assert failure.value.code == "insufficient_memory" and details["fits"] is False
    assert details["plans"][0]["actions"][0] == {"kind": "stop", "target": "replica-a", "frees_bytes": 40 * GIB}
    # Reserving again for the same holder replaces its figure.
    memory.reserve_memory(cpu_node, "replica-a", 10 * GIB)
    assert MemoryReservation.objects.get(holder="replica-a").bytes == 10 * GIB


@pytest.mark.django_db
def test_no_reservation_on_a_cordoned_node_or_a_mig_card_with_nothing_carved(cpu_node, mig_node):
    Node.objects.filter(pk=cpu_node.pk).update(state=Node.State.CORDONED)
    with pytest.raises(NotPlaceable):
        memory.reserve_memory(cpu_node, "x", GIB)
    empty = mig_node.accelerators.get(index=1, kind=Accelerator.Kind.GPU)
    with pytest.raises(NotPlaceable, match="no instances are carved"):
        memory.reserve_memory(mig_node, "y", GIB, accelerator=empty)
    instance = mig_node.accelerators.get(profile="2g.20gb")
    assert memory.reserve_memory(mig_node, "z", 10 * GIB, accelerator=instance).accelerator == instance


def _in_thread(target, results, name):
    def run():
        try:
            results[name] = target()
        except Exception as error:  # the test inspects what each caller got
            results[name] = error
        finally:
            close_old_connections()
            connection.close()
    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_deploys_cannot_claim_the_same_free_memory(cpu_node):
    # 64 GiB - 8 GiB margin - 4 GiB used outside = 52 GiB free: room for one 30 GiB claim, not two.
    barrier = threading.Barrier(2)
    results = {}

    def claim(name):
        def go():
            barrier.wait(timeout=10)
            return memory.reserve_memory(cpu_node, name, 30 * GIB)
        return go

    threads = [_in_thread(claim(name), results, name) for name in ("first", "second")]
    for thread in threads:
        thread.join(timeout=30)
    outcomes = sorted(type(r).__name__ for r in results.values())
    assert outcomes == ["InsufficientMemory", "MemoryReservation"]
    assert MemoryReservation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_claim_waits_for_the_lock_and_then_sees_the_other_claim(cpu_node):
    """Replays the race: one transaction holds the node's lock and claims; the other must wait,
    then find the memory taken (check-then-act would have let both through)."""
    from django.db import transaction

    from scheduler.locks import lock_budget

    holding, release, results = threading.Event(), threading.Event(), {}

    def holder():
        with transaction.atomic():
            lock_budget(cpu_node)
            MemoryReservation.objects.create(node=cpu_node, holder="held", bytes=30 * GIB)
            holding.set()
            release.wait(timeout=30)
        return "committed"

    first = _in_thread(holder, results, "holder")
    assert holding.wait(timeout=10)
    second = _in_thread(lambda: memory.reserve_memory(cpu_node, "late", 30 * GIB), results, "late")

    def late_waits_on_a_lock():
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND datname = current_database()")
            return cursor.fetchone()[0] >= 1

    wait_until(late_waits_on_a_lock, timeout=10, what="the second claim waiting on the node's row lock")
    assert "late" not in results
    release.set()
    first.join(timeout=10)
    second.join(timeout=10)
    assert results["holder"] == "committed"
    assert isinstance(results["late"], InsufficientMemory)
