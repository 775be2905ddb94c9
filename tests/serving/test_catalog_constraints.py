"""Placement constraints from the catalog: a profile's accelerator class (one or a list), node
selector, minimum disk and MIG acceptance are checked with the field named, reach the placement
policy, and place a replica only where they hold — refused with the constraint's name otherwise;
the weights key comes from the entry, so nodes holding the file are preferred."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from django.core.cache import cache

from scheduler.nvml import discover_gpus
from scheduler.policy.plan import schedule
from scheduler.services import EngineReport, NodeReport, register_node, set_labels
from serving import queues
from serving.catalog import entries, profiles, validation
from serving.catalog.errors import InvalidModelEntry
from serving.control import placement
from serving.models import Deployment, ModelEntry
from serving.node.discovery import local_node_report
from tenancy.audit import Actor
from tests.assets.recorded_nvml import RecordedNvml, recorded_smi

ACTOR = Actor(system="tests")
GIB = 2**30
COMMIT = "0" * 40


def whole(**profile):
    return {"name": "tiny", "task": "chat", "format": "gguf", "source_kind": "hub", "source_repo": "acme/Tiny-GGUF",
            "source_revision": COMMIT, "service_class": "standard", "scaling_min": 0, "scaling_max": 1,
            "profiles": [{"name": "cpu", "engine": "llamacpp", "file": "/m/tiny.gguf", "context": 4096, **profile}]}


# --- validation: each field named, with a stable code -------------------------------------------------

def test_well_formed_constraints_have_no_problems():
    assert validation.problems_of(whole(gpus=1, accelerator_class="h100", node_selector={"zone": "a"},
                                        min_disk="40 GiB", mig=False)) == []
    assert validation.problems_of(whole(gpus=1, accelerator_class=["h100-80g", "a100"], min_disk=10 * GIB)) == []


@pytest.mark.parametrize("constraint, field, code", [
    ({"gpus": 1, "accelerator_class": "h 100"}, "accelerator_class", "invalid_accelerator_class"),
    ({"gpus": 1, "accelerator_class": []}, "accelerator_class", "invalid_accelerator_class"),
    ({"gpus": 1, "accelerator_class": ["h100", "H100"]}, "accelerator_class", "invalid_accelerator_class"),
    ({"gpus": 1, "accelerator_class": 100}, "accelerator_class", "invalid_accelerator_class"),
    ({"accelerator_class": "h100"}, "accelerator_class", "invalid_accelerator_class"),  # a CPU profile
    ({"node_selector": ["zone=a"]}, "node_selector", "invalid_node_selector"),
    ({"node_selector": {"zone": "a b"}}, "node_selector", "invalid_node_selector"),
    ({"node_selector": {"": "a"}}, "node_selector", "invalid_node_selector"),
    ({"min_disk": "lots"}, "min_disk", "invalid_min_disk"),
    ({"min_disk": -1}, "min_disk", "invalid_min_disk"),
    ({"min_disk": True}, "min_disk", "invalid_min_disk"),
    ({"mig": "no"}, "mig", "invalid_mig"),
])
def test_a_wrong_constraint_is_refused_naming_its_field_with_a_stable_code(constraint, field, code):
    with pytest.raises(InvalidModelEntry) as refused:
        validation.require_valid(whole(**constraint))
    [problem] = refused.value.details["problems"]
    assert problem["field"] == f"profiles[0].{field}" and problem["code"] == code
    assert refused.value.code == "invalid_model_entry" and f"profiles[0].{field}" in refused.value.message


@pytest.mark.parametrize("written, size", [(0, 0), (5, 5), ("40 GiB", 40 * GIB), ("500MB", 500 * 10**6),
                                           ("1.5 TB", 15 * 10**11), ("2048", 2048), ("3 kib", 3072)])
def test_min_disk_takes_bytes_or_a_size(written, size):
    assert profiles.size_bytes(written) == size


def test_the_constraints_become_the_policys_profile_fields(settings, tmp_path):
    settings.SCHEDULER_MODEL_ROOTS = [tmp_path.resolve()]
    entry = ModelEntry(name="m", profiles=[{"name": "gpu", "engine": "llamacpp", "gpus": 1,
                                            "file": str(tmp_path.resolve() / "hub" / "m.gguf"),
                                            "accelerator_class": ["h100", "a100"], "node_selector": {"zone": "a"},
                                            "min_disk": "2 GiB", "mig": False}])
    from scheduler.policy.inputs import DesiredModel, Profile
    model = profiles.constrained(DesiredModel("m", (Profile("gpu", "llamacpp", 1, GIB),),
                                              minimal=(Profile("gpu", "llamacpp", 0, GIB),)), entry)
    [profile], [minimal] = model.profiles, model.minimal
    assert profile.accelerator_class == ("h100", "a100") and dict(profile.node_selector) == {"zone": "a"}
    assert profile.min_disk_bytes == 2 * GIB and profile.allow_mig is False and profile.memory_bytes == GIB
    assert dict(minimal.node_selector) == {"zone": "a"}  # the CPU rung stays on the labelled nodes
    assert model.weights_key == "hub/m.gguf"  # as a node reports its model root's files


# --- placement: only where the constraints hold, refused by name otherwise ---------------------------

@pytest.fixture
def catalog(db, tmp_path, settings, tiny_model, monkeypatch):
    """A verified local model wanting one replica, and the machine's own node (unlabelled)."""
    cache.clear()
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    plain = register_node(dataclasses.replace(local_node_report(), name="plain"))
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append(replica.node.name))
    entry = entries.import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "t.gguf"), name="placed")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1)
    return ModelEntry.objects.get(pk=entry.pk), plain, sent


def constrain(entry, **constraint):
    return entries.save_entry(ACTOR, {"profiles": [{**entry.profiles[0], "context": 256, **constraint}]}, entry=entry)


def test_a_node_selector_places_the_replica_only_on_a_labelled_node(catalog, django_capture_on_commit_callbacks):
    entry, plain, sent = catalog
    labelled = register_node(dataclasses.replace(local_node_report(), name="zoned"))
    set_labels(labelled, ACTOR, {"zone": "a"})
    constrain(entry, node_selector={"zone": "a"})
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["launched"] == ["placed"]
    assert Deployment.objects.get(name="placed").node.name == "zoned"


def test_a_label_no_node_carries_is_refused_by_its_name(catalog):
    entry, _, _ = catalog
    constrain(entry, node_selector={"zone": "a"})
    answer = placement.reconcile()
    assert answer["launched"] == [] and answer["unschedulable"]["placed"].startswith("profile ")
    assert "needs label zone=a; no ready node" in answer["unschedulable"]["placed"]
    [refused] = schedule(placement.snapshot()).unschedulable
    assert refused.code == "node-selector"


def test_the_headroom_check_sees_the_constraint_too(catalog):
    """The catalog's "room for more" asks the same policy with the same constrained model: a label
    no node carries leaves no room, and a labelled node brings it back."""
    from serving.catalog.room import room_for_more

    entry, _, _ = catalog
    constrain(entry, node_selector={"zone": "a"})
    assert room_for_more(ModelEntry.objects.get(pk=entry.pk)).more == 0
    set_labels(register_node(dataclasses.replace(local_node_report(), name="zoned")), ACTOR, {"zone": "a"})
    room = room_for_more(ModelEntry.objects.get(pk=entry.pk))
    assert room.more >= 1 and set(room.nodes) == {"zoned"}


@pytest.fixture
def gpu_nodes(db):
    """An H100 node and an A100 node with MIG instances, both with llama.cpp (as recorded machines)."""
    engines = (EngineReport(kind="llamacpp", version="b1"),)
    h100 = register_node(NodeReport(name="h100-01", address="127.0.0.1", cpu_count=128, memory_total_bytes=2048 * GIB,
                                    memory_available_bytes=1900 * GIB, engines=engines,
                                    gpus=discover_gpus(RecordedNvml.load("h100x8"), recorded_smi(None))))
    a100 = register_node(NodeReport(name="a100-01", address="127.0.0.1", cpu_count=64, memory_total_bytes=1024 * GIB,
                                    memory_available_bytes=1000 * GIB, engines=engines,
                                    gpus=discover_gpus(RecordedNvml.load("a100-mig"), recorded_smi(None))))
    return h100, a100


def test_an_accelerator_class_places_only_on_its_gpus_and_a_missing_class_is_named(catalog, gpu_nodes):
    entry, _, _ = catalog
    constrain(entry, gpus=1, accelerator_class="h100")
    plan = schedule(placement.snapshot())
    [launch] = plan.launches
    assert launch.node == "h100-01" and launch.accelerators
    constrain(ModelEntry.objects.get(pk=entry.pk), gpus=1, accelerator_class=["l40s", "b200"])
    [refused] = schedule(placement.snapshot()).unschedulable
    assert refused.code == "accelerator-class"
    assert "needs accelerator class l40s or b200; no ready node has one" in refused.reason


def test_a_profile_refusing_mig_stays_off_the_instances(catalog, gpu_nodes):
    from scheduler.models import Accelerator
    kinds = {str(a.public_id): a.kind for a in Accelerator.objects.all()}
    entry, _, _ = catalog
    constrain(entry, gpus=1, accelerator_class="a100-80g")
    [launch] = schedule(placement.snapshot()).launches
    assert launch.node == "a100-01" and kinds[launch.accelerators[0]] == "mig"  # best fit: the smallest room
    constrain(ModelEntry.objects.get(pk=entry.pk), gpus=1, accelerator_class="a100-80g", mig=False)
    [launch] = schedule(placement.snapshot()).launches
    assert launch.node == "a100-01" and kinds[launch.accelerators[0]] == "gpu"


def test_nodes_holding_the_weights_are_preferred(catalog, settings):
    entry, plain, _ = catalog
    key = profiles.weights_key(entry)
    assert key and not key.startswith("/")
    holder = register_node(dataclasses.replace(local_node_report(), name="zz-holder"))
    from scheduler.models import HeldWeight, ModelDirectory
    directory = ModelDirectory.objects.create(node=holder, path="/elsewhere/models")
    HeldWeight.objects.create(directory=directory, path=key, size_bytes=1, format="gguf")
    snap = placement.snapshot()
    assert next(m for m in snap.models if m.id == "placed").weights_key == key
    [launch] = schedule(snap).launches
    assert launch.node == "zz-holder"  # by name, "plain" would come first
