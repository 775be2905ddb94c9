"""Discovery through the NVML adapter, fed with recorded outputs of real machines, into inventory rows."""

import dataclasses
import json

import pytest

from scheduler.models import Accelerator, AcceleratorSample, Node, NodeSample
from scheduler.nvml import discover_gpus, gpu_class, mig_class
from scheduler.reports import HeldWeightReport, ModelDirectoryReport
from scheduler.services import NodeReport, register_node
from tests.assets.recorded_nvml import RECORDED, RecordedNvml, recorded_smi

GIB = 2**30
MIB = 2**20


def nvml_discovery(machine):
    return discover_gpus(RecordedNvml.load(machine), recorded_smi(None))


def smi_discovery(machine):
    """NVML present but failing (driver not loaded): the adapter falls back to nvidia-smi."""
    return discover_gpus(RecordedNvml(init_error="DriverNotLoaded"), recorded_smi(machine))


def report(name, discovery, **extra):
    return NodeReport(name=name, address="127.0.0.1", cpu_count=64, memory_total_bytes=512 * GIB,
                      memory_available_bytes=480 * GIB, cpu_load_1m=1.5, gpus=discovery, **extra)


# --- the adapter, without a database -------------------------------------------------------------

@pytest.mark.parametrize("machine", ["h100x8", "a100-mig", "l40s-unhealthy"])
def test_nvml_and_nvidia_smi_readings_of_the_same_machine_agree(machine):
    through_nvml, through_smi = nvml_discovery(machine), smi_discovery(machine)
    assert through_nvml.source == "nvml" and through_smi.source == "nvidia-smi"
    assert through_nvml.gpus == through_smi.gpus
    assert through_smi.driver_version == "550.90.07"


def test_cpu_only_machine_has_no_gpus_and_says_why():
    discovery = discover_gpus(RecordedNvml.without_library(), recorded_smi(None))
    assert discovery.gpus == ()
    assert "NVML library not found" in discovery.note


def test_without_nvml_or_nvidia_smi_no_gpus_are_read_and_the_note_says_so():
    discovery = discover_gpus(RecordedNvml(init_error="DriverNotLoaded"), recorded_smi(None))
    assert discovery.gpus == () and "nvidia-smi failed too" in discovery.note


def test_eight_h100s_are_read_with_memory_and_telemetry():
    gpus = nvml_discovery("h100x8").gpus
    assert len(gpus) == 8
    first = gpus[0]
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory_total_bytes == 81559 * MIB and first.memory_used_bytes == 71234 * MIB
    assert (first.utilisation_percent, first.temperature_c, first.power_watts, first.power_limit_watts) == (87.0, 58.0, 512.4, 700.0)
    assert gpus[1].throttle_reasons == ("sw_power_cap",)
    assert gpus[2].throttle_reasons == ("gpu_idle",)
    assert all(g.healthy for g in gpus)


def test_mig_instances_carry_profile_uuid_and_memory():
    card, empty, whole = nvml_discovery("a100-mig").gpus
    assert card.mig_enabled and [m.profile for m in card.mig_instances] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    assert [m.memory_total_bytes for m in card.mig_instances] == [40192 * MIB, 19968 * MIB, 9728 * MIB]
    assert all(m.uuid.startswith("MIG-") for m in card.mig_instances)
    assert card.utilisation_percent is None  # NVML does not give a MIG card's utilisation: absent, not 0
    assert empty.mig_enabled and empty.mig_instances == ()
    assert not whole.mig_enabled


def test_unhealthy_gpu_is_reported_with_its_reason():
    gpus = nvml_discovery("l40s-unhealthy").gpus
    assert [g.healthy for g in gpus] == [True, True, False, True]
    assert "Row remapping failed" in gpus[2].health_reason


def test_a_lost_gpu_does_not_hide_the_others():
    recording = json.loads((RECORDED / "h100x8.pynvml.json").read_text())
    recording["devices"][3]["errors"] = {"nvmlDeviceGetMemoryInfo": "GpuIsLost"}
    gpus = discover_gpus(RecordedNvml(recording), recorded_smi(None)).gpus
    assert len(gpus) == 8
    assert gpus[3].healthy is False and "lost" in gpus[3].health_reason
    assert gpus[3].memory_total_bytes is None  # not read: unknown, not zero
    assert all(g.healthy for i, g in enumerate(gpus) if i != 3)


@pytest.mark.parametrize("name, memory, expected", [
    ("NVIDIA H100 80GB HBM3", 81559 * MIB, "h100-80g"),
    ("NVIDIA A100-SXM4-80GB", 81920 * MIB, "a100-80g"),
    ("NVIDIA A100-PCIE-40GB", 40960 * MIB, "a100-40g"),
    ("NVIDIA L40S", 46068 * MIB, "l40s-48g"),
    ("NVIDIA H100 PCIe", 81559 * MIB, "h100-80g"),
    ("NVIDIA H200", 143771 * MIB, "h200-141g"),
    ("NVIDIA GeForce RTX 4090", 24564 * MIB, "rtx4090-24g"),
    ("Tesla T4", 15360 * MIB, "t4-16g"),
])
def test_gpu_class_comes_from_the_card_and_its_memory(name, memory, expected):
    assert gpu_class(name, memory) == expected


def test_mig_class_names_card_and_profile():
    assert mig_class("a100-80g", "3g.40gb") == "a100-80g-mig-3g.40gb"


# --- inventory rows ------------------------------------------------------------------------------

@pytest.mark.django_db
def test_h100_node_becomes_eight_placeable_accelerators():
    node = register_node(report("h100-01", nvml_discovery("h100x8")))
    rows = list(node.accelerators.order_by("index"))
    assert len(rows) == 8
    assert {r.accelerator_class for r in rows} == {"h100-80g"}
    assert all(r.placeable and r.kind == Accelerator.Kind.GPU for r in rows)
    assert rows[0].memory_used_bytes == 71234 * MIB and rows[0].power_limit_watts == 700.0
    assert node.gpu_source == "nvml" and node.driver_version == "550.90.07"


@pytest.mark.django_db
def test_mig_card_is_placed_as_its_instances_and_an_uncarved_one_not_at_all():
    node = register_node(report("a100-01", smi_discovery("a100-mig")))
    card, empty, whole = node.accelerators.filter(kind=Accelerator.Kind.GPU).order_by("index")
    assert not card.placeable and "placed as its 3 instance(s)" in card.unplaceable_reason
    assert not empty.placeable and "no instances are carved" in empty.unplaceable_reason
    assert whole.placeable and whole.accelerator_class == "a100-80g"
    instances = list(card.instances.order_by("mig_index"))
    assert [i.accelerator_class for i in instances] == [
        "a100-80g-mig-3g.40gb", "a100-80g-mig-2g.20gb", "a100-80g-mig-1g.10gb"]
    assert all(i.placeable and i.uuid.startswith("MIG-") for i in instances)
    assert instances[0].memory_total_bytes == 40192 * MIB
    placeable = Accelerator.objects.filter(node=node, placeable=True)
    assert placeable.count() == 4  # three instances and the card not in MIG mode


@pytest.mark.django_db
def test_unhealthy_gpu_is_kept_out_of_placement_with_the_reason():
    node = register_node(report("l40s-01", nvml_discovery("l40s-unhealthy")))
    sick = node.accelerators.get(index=2)
    assert sick.healthy is False and not sick.placeable
    assert sick.unplaceable_reason.startswith("Unhealthy: Row remapping failed")
    assert node.accelerators.filter(placeable=True).count() == 3
    assert set(node.accelerators.values_list("accelerator_class", flat=True)) == {"l40s-48g"}


@pytest.mark.django_db
def test_cpu_only_node_has_no_accelerators_and_keeps_the_note():
    node = register_node(report("cpu-01", discover_gpus(RecordedNvml.without_library(), recorded_smi(None))))
    assert not node.accelerators.exists()
    assert "no GPUs" in node.gpu_note


@pytest.mark.django_db
def test_the_same_report_twice_changes_no_inventory_row():
    discovery = nvml_discovery("a100-mig")
    register_node(report("a100-01", discovery))
    before = {a.uuid: (a.pk, a.updated_at) for a in Accelerator.objects.all()}
    register_node(report("a100-01", discovery))
    after = {a.uuid: (a.pk, a.updated_at) for a in Accelerator.objects.all()}
    assert before == after


@pytest.mark.django_db
def test_relayout_of_a_mig_card_replaces_its_instances():
    discovery = nvml_discovery("a100-mig")
    node = register_node(report("a100-01", discovery))
    card = discovery.gpus[0]
    relaid = dataclasses.replace(card, mig_instances=card.mig_instances[:1])
    register_node(report("a100-01", dataclasses.replace(discovery, gpus=(relaid, *discovery.gpus[1:]))))
    assert node.accelerators.filter(kind=Accelerator.Kind.MIG).count() == 1


@pytest.mark.django_db
def test_gpus_not_looked_at_are_kept_but_gpus_gone_are_removed():
    node = register_node(report("h100-01", nvml_discovery("h100x8")))
    register_node(report("h100-01", None))  # this heartbeat did not look at the GPUs
    assert node.accelerators.count() == 8
    discovery = nvml_discovery("h100x8")
    register_node(report("h100-01", dataclasses.replace(discovery, gpus=discovery.gpus[:7])))
    assert node.accelerators.count() == 7


@pytest.mark.django_db
def test_telemetry_samples_are_bounded(settings):
    settings.SCHEDULER_TELEMETRY_SAMPLES = 3
    discovery = nvml_discovery("h100x8")
    for _ in range(5):
        node = register_node(report("h100-01", discovery))
    first = node.accelerators.get(index=0)
    assert AcceleratorSample.objects.filter(accelerator=first).count() == 3
    assert NodeSample.objects.filter(node=node).count() == 3
    assert NodeSample.objects.filter(node=node).first().cpu_load_1m == 1.5


@pytest.mark.django_db
def test_telemetry_not_measured_makes_no_sample():
    node = register_node(NodeReport(name="quiet", address="127.0.0.1"))
    assert not NodeSample.objects.filter(node=node).exists()
    assert node.cpu_load_1m is None


@pytest.mark.django_db
def test_model_directories_and_held_weights_follow_the_report():
    directories = (ModelDirectoryReport("/srv/models", (HeldWeightReport("qwen.gguf", 123, "gguf"),
                                                        HeldWeightReport("smol.gguf", 45, "gguf"))),)
    node = register_node(report("cpu-01", None, model_directories=directories))
    assert sorted(node.model_directories.get().weights.values_list("path", flat=True)) == ["qwen.gguf", "smol.gguf"]
    smaller = (ModelDirectoryReport("/srv/models", (HeldWeightReport("smol.gguf", 45, "gguf"),)),)
    register_node(report("cpu-01", None, model_directories=smaller))
    assert list(node.model_directories.get().weights.values_list("path", flat=True)) == ["smol.gguf"]
    register_node(report("cpu-01", None, model_directories=()))
    assert not node.model_directories.exists()


@pytest.mark.django_db
def test_duplicate_gpu_uuids_are_refused():
    from scheduler.errors import InvalidNodeReport

    discovery = nvml_discovery("h100x8")
    twice = dataclasses.replace(discovery, gpus=(discovery.gpus[0], discovery.gpus[0]))
    with pytest.raises(InvalidNodeReport) as failure:
        register_node(report("h100-01", twice))
    assert "gpus" in failure.value.details
    assert not Node.objects.exists()
