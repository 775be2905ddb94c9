"""GPU memory measured after every load: the agent reads, through the NVML adapter, the device
memory the engine really took and sends the readings with the start job's completion; the control
plane measures from them — the engine's processes' own figures where the driver gives them, else the
device's use after the load less before it — records which one it was, and the estimator learns
from it as it does from peak RSS on CPUs. The reference of a load record is the estimator's own
figure, not the already calibrated reservation; flash attention on and off never calibrate each
other; the model card shows reserved against measured and warns when measured is more.

No GPU exists here: NVML answers from a recording of a real H100 machine (``h100x8``), with the
load's figures on its idle GPU 2 and the engine's real PID (the engine is a real llama-server on
the CPU, launched by the agent's own code, played in this process by ``tests.assets.node_inline``)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest

from scheduler import memory
from scheduler.estimation.engines import LlamaCppConfig
from scheduler.estimation.reading import read_model
from scheduler.models import Accelerator, CalibrationRecord
from scheduler.nvml import (
    DEVICE_DELTA,
    PER_PROCESS,
    DeviceMemory,
    LoadMemory,
    discover_gpus,
    load_memory,
    read_device_memory,
)
from scheduler.policy.calibration import classify_exit
from scheduler.services import register_node
from serving.catalog import entries
from serving.control import failures
from serving.deployments import service
from serving.deployments.states import holder_of
from serving.models import Deployment, Replica
from serving.node import discovery, runtime as node_runtime
from serving.runtimes.process import ProcessRuntime
from tenancy.audit import Actor
from tests.assets.agent import NODE
from tests.assets.hub_server import mirror_root  # noqa: F401  (fixture)
from tests.assets.node_inline import InlineClient, run_next
from tests.assets.recorded_nvml import RECORDED, RecordedNvml, recorded_smi

ADMIN = Actor(system="tests")
MIB = 2**20
IDLE = 2  # GPU 2 of the recording: nothing on it
MACHINE = json.loads((RECORDED / "h100x8.pynvml.json").read_text())
IDLE_UUID = MACHINE["devices"][IDLE]["uuid"]


def recording(*, used_extra: int = 0, processes: list | None = None, supports_processes: bool = True) -> dict:
    """The H100 machine as recorded, with ``used_extra`` bytes more used on GPU 2 and the compute
    processes listed there (``supports_processes=False``: a driver that does not list them)."""
    machine = copy.deepcopy(MACHINE)
    gpu = machine["devices"][IDLE]
    gpu["memory"]["used"] += used_extra
    gpu["memory"]["free"] -= used_extra
    if supports_processes:
        gpu["processes"] = list(processes or [])
    return machine


# --- the adapter and the choice between the two measurements (no database) -----------------------

def test_the_adapter_reads_used_memory_and_each_processs_figure_by_uuid():
    nvml = RecordedNvml(recording(used_extra=3 * MIB, processes=[{"pid": 41, "usedGpuMemory": 2 * MIB},
                                                                 {"pid": 42, "usedGpuMemory": None}]))
    found = read_device_memory([IDLE_UUID, "GPU-not-on-this-machine"], nvml)
    assert list(found) == [IDLE_UUID]  # a device NVML does not find is absent, not zero
    assert found[IDLE_UUID].used_bytes == 3 * MIB
    assert found[IDLE_UUID].processes == {41: 2 * MIB, 42: None}


def test_without_nvml_or_without_per_process_support_those_figures_are_unknown():
    assert read_device_memory([IDLE_UUID], RecordedNvml.without_library()) == {}
    assert read_device_memory([IDLE_UUID], RecordedNvml(init_error="DriverNotLoaded")) == {}
    unsupported = read_device_memory([IDLE_UUID], RecordedNvml(recording(supports_processes=False)))
    assert unsupported[IDLE_UUID].processes is None and unsupported[IDLE_UUID].used_bytes == 0


def device(uuid, used, processes=None):
    return DeviceMemory(uuid=uuid, used_bytes=used, processes=processes)


def test_per_process_figures_win_and_the_fullest_gpu_is_the_figure():
    before = {"a": device("a", 10, {}), "b": device("b", 10, {})}
    after = {"a": device("a", 500, {7: 300, 8: 100, 99: 50}), "b": device("b", 400, {9: 350})}
    taken = load_memory(["a", "b"], {7, 8, 9}, after, before)
    assert (taken.bytes, taken.method, dict(taken.per_device)) == (400, PER_PROCESS, {"a": 400, "b": 350})


def test_a_withheld_process_figure_falls_back_to_the_device_delta():
    before = {"a": device("a", 1000, {})}
    after = {"a": device("a", 1600, {7: None})}
    assert load_memory(["a"], {7}, after, before) == LoadMemory(600, DEVICE_DELTA, {"a": 600})
    not_listed = {"a": device("a", 1600, {12: 500})}  # the engine's PID is not among them (a container)
    assert load_memory(["a"], {7}, not_listed, before).method == DEVICE_DELTA


@pytest.mark.parametrize("before, after, spoiled, why", [
    (None, {"a": device("a", 1600)}, "", "not read before the load"),
    ({"a": device("a", None)}, {"a": device("a", 1600)}, "", "was not read before and after"),
    ({"a": device("a", 1600)}, {"a": device("a", 1500)}, "", "did not grow"),
    ({"a": device("a", 1000)}, {"a": device("a", 1600)}, "replica x started", "cannot be trusted: replica x"),
    ({"a": device("a", 1000)}, {}, "", "was not read before and after"),
])
def test_a_figure_that_cannot_be_read_is_unknown_never_zero(before, after, spoiled, why):
    taken = load_memory(["a"], {7}, after, before, delta_spoiled=spoiled)
    assert taken.bytes is None and taken.method == "" and why in taken.reason


# --- loads on a recorded GPU, through the agent's own start path -----------------------------------

@pytest.fixture
def gpu_node(db):
    """This machine (its engines) under the agent's name, with the GPUs of the recorded H100 machine."""
    return register_node(dataclasses.replace(discovery.local_node_report(), name=NODE,
                                             gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))


@pytest.fixture
def idle_gpu(gpu_node):
    return Accelerator.objects.get(node=gpu_node, uuid=IDLE_UUID)


@pytest.fixture
def engines(tmp_path, settings, monkeypatch, model_root):
    """This process as the node's agent's runtime: its own engines directory, every engine it
    launched stopped after."""
    settings.SERVING_ENGINE_DIR = tmp_path / "engines"
    settings.SERVING_DRAIN_SECONDS = 0
    runtime = ProcessRuntime(tmp_path / "engines")
    monkeypatch.setattr(node_runtime, "_runtimes", {"process": runtime})
    yield runtime
    for handle in runtime.managed():
        runtime.stop(handle, grace_seconds=5)


def start_on_the_node(gpu: Accelerator) -> None:
    """The node's agent claims the replica's start job and does it (fetch, admit, launch, watch, the
    readings sent with its completion) with its own code, in this process."""
    run_next(InlineClient(gpu.node), "start")


class LoadOnRecordedGpu:
    """NVML as the agent's half reads it (``discovery.agent_nvml``) around one load on GPU 2: as
    recorded before the engine starts, then with ``device_bytes`` more used and the engine's process
    (the PID of the handle the agent reported at its launch) listed holding ``process_bytes``
    (``None``: the driver withholds it), or no process list at all."""

    def __init__(self, *, device_bytes: int, process_bytes: int | None, supports_processes: bool = True,
                 library: bool = True):
        self.device_bytes, self.process_bytes = device_bytes, process_bytes
        self.supports_processes, self.library = supports_processes, library
        self.reads = 0

    def __call__(self):
        self.reads += 1
        if not self.library:
            return RecordedNvml.without_library()
        if self.reads == 1:  # before the engine starts
            return RecordedNvml(recording(supports_processes=self.supports_processes))
        engine_pid = Replica.objects.get(deployment__name="tiny").handle["pid"]  # this run's PID, in the recording
        return RecordedNvml(recording(used_extra=self.device_bytes, supports_processes=self.supports_processes,
                                      processes=[{"pid": engine_pid, "usedGpuMemory": self.process_bytes}]))


def deploy_on(gpu: Accelerator, model_root: Path, model: Path, name: str = "tiny", **config) -> Replica:
    path = model_root / "tiny.gguf"  # one file, one model key, whatever the deployment is called
    if not path.exists():
        shutil.copy(model, path)
    deployment = service.deploy(ADMIN, service.DeployRequest(
        name=name, model_path=str(path), node=gpu.node, accelerator=gpu, config={"context": 256, **config}))
    return deployment.replica_set.get()


ON_THE_GPU = {"ctx_size": 256, "n_gpu_layers": -1}  # the deployment's configuration in the estimator's names


def raw_of(replica: Replica, gpu: Accelerator) -> int:
    """The estimator's own figure for the replica's launch, before any calibration."""
    config = memory.engine_config("llamacpp", ON_THE_GPU)
    return memory.raw_estimate(read_model(replica.deployment.model_path), "llamacpp", config, gpu).total_bytes


def next_estimate(replica: Replica, gpu: Accelerator, **config):
    return memory.estimate_and_fit(replica.deployment.model_path, "llamacpp", {**ON_THE_GPU, **config},
                                   node=gpu.node, accelerator=gpu).estimate


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_the_engines_own_device_memory_calibrates_the_next_estimate(engines, idle_gpu, model_root, tiny_model,
                                                                    monkeypatch):
    replica = deploy_on(idle_gpu, model_root, tiny_model)
    raw = raw_of(replica, idle_gpu)
    assert replica.deployment.estimate["total_bytes"] == raw  # what deploy estimated, nothing learnt yet
    taken = int(raw * 0.8)  # the engine's process on GPU 2 (the device shows more: another context)
    nvml = LoadOnRecordedGpu(device_bytes=taken + 64 * MIB, process_bytes=taken)
    monkeypatch.setattr(discovery, "agent_nvml", nvml)
    start_on_the_node(idle_gpu)
    replica.refresh_from_db()
    assert replica.state == "ready" and nvml.reads == 2
    record = CalibrationRecord.objects.get()
    assert (record.measured_bytes, record.measurement) == (taken, CalibrationRecord.Measurement.PER_PROCESS)
    assert (record.device, record.holder, record.estimated_bytes) == ("h100-80g", holder_of(replica), raw)
    after = next_estimate(replica, idle_gpu)
    assert after.calibration["rule"] == "measured" and after.uncalibrated_total_bytes == raw
    assert after.total_bytes == pytest.approx(taken * 1.05, abs=1)


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_driver_without_per_process_figures_calibrates_from_the_device_delta(engines, idle_gpu, model_root,
                                                                              tiny_model, monkeypatch):
    replica = deploy_on(idle_gpu, model_root, tiny_model)
    raw = raw_of(replica, idle_gpu)
    grew = int(raw * 1.3)
    monkeypatch.setattr(discovery, "agent_nvml", LoadOnRecordedGpu(device_bytes=grew, process_bytes=None))
    start_on_the_node(idle_gpu)
    record = CalibrationRecord.objects.get()
    assert (record.measured_bytes, record.measurement) == (grew, CalibrationRecord.Measurement.DEVICE_DELTA)
    assert record.get_measurement_display() == "the device's use before and after the load (NVML)"
    neighbour = next_estimate(replica, idle_gpu, ctx_size=512)  # another context: the ratio carries over
    assert neighbour.calibration["rule"] == "ratio"
    assert neighbour.total_bytes == pytest.approx(neighbour.uncalibrated_total_bytes * grew / raw, rel=1e-6)


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("driver", [
    {"library": False},  # no NVML at all
    {"supports_processes": False},  # no process list, and the device's use did not grow
], ids=["no-nvml", "no-figure"])
def test_a_load_whose_device_memory_is_unknown_records_nothing_and_says_so(engines, idle_gpu, model_root,
                                                                          tiny_model, monkeypatch, caplog, driver):
    replica = deploy_on(idle_gpu, model_root, tiny_model)
    monkeypatch.setattr(discovery, "agent_nvml", LoadOnRecordedGpu(device_bytes=0, process_bytes=None, **driver))
    with caplog.at_level(logging.INFO, logger="serving.control.failures"):
        start_on_the_node(idle_gpu)
    replica.refresh_from_db()
    assert replica.state == "ready"  # serving does not wait on a measurement
    assert not CalibrationRecord.objects.exists()
    assert any("no calibration record" in line and "its device memory is not known" in line
               for line in caplog.messages), caplog.messages
    assert next_estimate(replica, idle_gpu).calibration is None


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_no_device_delta_is_trusted_while_another_engine_loads_on_the_same_gpu(engines, idle_gpu, model_root,
                                                                               tiny_model, monkeypatch, caplog,
                                                                               settings):
    settings.SERVING_STARTUP_SLOTS = 2
    neighbour = Deployment.objects.create(name="neighbour", model_path=str(tiny_model), node=idle_gpu.node,
                                          gpu_uuids=[IDLE_UUID], state="loading")
    loading = Replica.objects.create(deployment=neighbour, node=idle_gpu.node, port=20999, state="loading")
    replica = deploy_on(idle_gpu, model_root, tiny_model)
    monkeypatch.setattr(discovery, "agent_nvml", LoadOnRecordedGpu(device_bytes=900 * MIB, process_bytes=None))
    with caplog.at_level(logging.INFO, logger="serving.control.failures"):
        start_on_the_node(idle_gpu)
    replica.refresh_from_db()
    assert replica.state == "ready" and not CalibrationRecord.objects.exists()
    assert any(f"cannot be trusted: replica {loading.public_id}" in line for line in caplog.messages), caplog.messages


# --- the reference, flash attention, vLLM (records only, no engine) --------------------------------

@pytest.mark.django_db
def test_a_second_load_is_recorded_against_the_uncalibrated_estimate_not_the_reservation(
        idle_gpu, model_root, tiny_model):
    first = deploy_on(idle_gpu, model_root, tiny_model, name="first")
    raw = raw_of(first, idle_gpu)
    assert first.memory_reserved_bytes == raw  # nothing learnt yet
    measured = int(raw * 0.8)
    failures.calibrate(first, None, LoadMemory(measured, PER_PROCESS, {IDLE_UUID: measured}))
    service.stop(ADMIN, first.deployment)
    second = deploy_on(idle_gpu, model_root, tiny_model, name="second")
    assert second.memory_reserved_bytes == pytest.approx(measured * 1.05, abs=1)  # calibrated
    failures.calibrate(second, None, LoadMemory(measured, PER_PROCESS, {IDLE_UUID: measured}))
    newest = CalibrationRecord.objects.first()
    assert newest.holder == holder_of(second) and newest.estimated_bytes == raw
    assert newest.measured_bytes / newest.estimated_bytes == pytest.approx(0.8, abs=0.001)  # not ~1
    neighbour = next_estimate(second, idle_gpu, ctx_size=512)
    assert neighbour.total_bytes == pytest.approx(neighbour.uncalibrated_total_bytes * 0.8, rel=1e-3)


@pytest.mark.django_db
def test_the_cpu_path_records_its_peak_against_the_uncalibrated_estimate_too(model_root, tiny_model):
    node = register_node(dataclasses.replace(discovery.local_node_report(), name=NODE))
    path = Path(shutil.copy(tiny_model, model_root / "cpu.gguf"))
    deployment = service.deploy(ADMIN, service.DeployRequest(name="cpu", model_path=str(path), node=node,
                                                             config={"context": 256}))
    replica = deployment.replica_set.get()
    config = memory.engine_config("llamacpp", {"ctx_size": 256})
    raw = memory.raw_estimate(read_model(path), "llamacpp", config).total_bytes
    Deployment.objects.filter(pk=deployment.pk).update(memory_reserved_bytes=raw * 3)  # as if calibrated high
    replica.deployment.refresh_from_db()
    failures.calibrate(replica, raw // 2)
    record = CalibrationRecord.objects.get()
    assert (record.device, record.estimated_bytes, record.measured_bytes) == ("cpu", raw, raw // 2)
    assert record.measurement == CalibrationRecord.Measurement.PEAK_RSS


@pytest.fixture
def shape(gguf_model):
    return read_model(gguf_model(layers=4, embedding=256, heads=4, kv_heads=2, context=4096))


def test_flash_attention_is_in_the_calibration_key(shape):
    on = LlamaCppConfig(ctx_size=1024).calibration_key(shape)
    off = LlamaCppConfig(ctx_size=1024, flash_attention=False).calibration_key(shape)
    assert on["flash_attention"] is True and off["flash_attention"] is False and on != off


@pytest.mark.django_db
def test_loads_with_flash_attention_on_and_off_never_calibrate_each_other(shape):
    off = LlamaCppConfig(ctx_size=1024, flash_attention=False)
    raw_off = memory.raw_estimate(shape, "llamacpp", off).total_bytes
    memory.record_load(shape, "llamacpp", "b1", off, "cpu", estimated_bytes=raw_off,
                       measured_bytes=int(raw_off * 1.5), measurement="peak_rss")
    same_on = memory.calibrated_estimate(shape, "llamacpp", LlamaCppConfig(ctx_size=1024), engine_version="b1")
    other_on = memory.calibrated_estimate(shape, "llamacpp", LlamaCppConfig(ctx_size=4096), engine_version="b1")
    assert same_on.calibration is None and other_on.calibration is None
    other_off = memory.calibrated_estimate(shape, "llamacpp", LlamaCppConfig(ctx_size=4096, flash_attention=False),
                                           engine_version="b1")
    assert other_off.calibration["rule"] == "ratio"
    assert other_off.total_bytes == pytest.approx(other_off.uncalibrated_total_bytes * 1.5, rel=1e-6)


@pytest.mark.django_db
def test_vllm_loads_teach_nothing_because_vllm_fills_the_pool_it_is_given(shape):
    """vLLM sizes its pool from the reservation: its measured use is the reservation, and learning
    from it would raise every next one by the margin. Its out-of-memory failures still teach."""
    config = memory.engine_config("vllm", {"max_model_len": 2048})
    raw = memory.raw_estimate(shape, "vllm", config).total_bytes
    memory.record_load(shape, "vllm", "0.11.0", config, "gpu", estimated_bytes=raw, measured_bytes=raw * 2,
                       measurement="process")
    assert memory.calibrated_estimate(shape, "vllm", config, engine_version="0.11.0").calibration is None
    memory.record_failure(shape, "vllm", "0.11.0", config, "gpu", estimated_bytes=raw,
                          classification=classify_exit(exit_code=1,
                                                       engine_log="torch.OutOfMemoryError: CUDA out of memory"))
    assert memory.calibrated_estimate(shape, "vllm", config, engine_version="0.11.0").calibration["rule"] == "oom"


# --- the model card ---------------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_card_shows_reserved_against_measured_and_warns_when_measured_is_more(
        client, admin_user, mirror_root, tiny_model, idle_gpu):  # noqa: F811  (mirror_root, a fixture)
    held = entries.import_local(ADMIN, tiny_model, name="tiny-held")
    node, shape = idle_gpu.node, read_model(entries.served_path(held))
    config = memory.engine_config("llamacpp", {"ctx_size": 256, "n_gpu_layers": -1})
    deployment = Deployment.objects.create(name=held.name, model_path=str(entries.served_path(held)), node=node,
                                           gpu_uuids=[IDLE_UUID], state="ready")
    over = Replica.objects.create(deployment=deployment, node=node, port=20001, state="ready",
                                  memory_reserved_bytes=100 * MIB, peak_memory_bytes=7 * MIB)
    under = Replica.objects.create(deployment=deployment, node=node, port=20002, state="ready",
                                   memory_reserved_bytes=100 * MIB, peak_memory_bytes=7 * MIB)
    unknown = Replica.objects.create(deployment=deployment, node=node, port=20003, state="ready",
                                     memory_reserved_bytes=100 * MIB, peak_memory_bytes=7 * MIB)
    for replica, measured, how in ((over, 130 * MIB, PER_PROCESS), (under, 90 * MIB, DEVICE_DELTA)):
        memory.record_load(shape, "llamacpp", "b1", config, "h100-80g", estimated_bytes=100 * MIB,
                           measured_bytes=measured, measurement=how, holder=holder_of(replica))
    client.force_login(admin_user)
    page = client.get(f"/models/held/{held.public_id}/").content.decode()

    def row(replica):
        start = page.index(f'data-replica="{replica.public_id}"')
        return page[start:page.index("</tr>", start)]

    assert "130.0\xa0MB" in row(over) and "the engine&#x27;s processes (NVML)" in row(over)
    assert 'data-warning="over-reservation"' in row(over) and "30.0\xa0MB over its reservation" in row(over)
    assert "90.0\xa0MB" in row(under) and "before and after the load" in row(under)
    assert "over-reservation" not in row(under)
    # A GPU replica whose device memory is unknown shows no figure: never its host memory instead.
    assert "7.0\xa0MB" not in row(unknown) and "not measured" in row(unknown)
