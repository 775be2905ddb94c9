"""Fetching from the hub into the mirror: pinned, verified, resumable, and refused up front when it
cannot end well. The real huggingface_hub client and a local hub server; files are generated."""

from __future__ import annotations

import hashlib

import pytest

from serving.catalog import fetch
from serving.catalog.errors import FetchRefused
from serving.catalog.fetch import FetchRequest
from serving.models import FetchJob, ModelEntry, ModelFile
from tenancy.audit import Actor
from tests.assets.gguf_models import ModelShape, write_gguf
from tests.assets.hub_server import hub, mirror_root  # noqa: F401  (fixtures)

ADMIN = Actor(system="tests")
pytestmark = pytest.mark.django_db


@pytest.fixture
def model_bytes(tmp_path):
    return write_gguf(tmp_path / "src.gguf", ModelShape(layers=4, embedding=128, feed_forward=512)).read_bytes()


def fetched(request: FetchRequest, actor=ADMIN) -> FetchJob:
    job = fetch.start(actor, request, enqueue=False)
    return fetch.run(job)


def test_fetch_pins_the_revision_verifies_each_file_and_records_the_entry(hub, mirror_root, model_bytes,
                                                                            monkeypatch,
                                                                            django_capture_on_commit_callbacks):
    hub.add("acme/Tiny-GGUF", {"tiny-Q4_K_M.gguf": model_bytes, "tiny-Q8_0.gguf": b"q8" * 10, "README.md": b"hi"})
    progress = []
    original = fetch._set_file
    monkeypatch.setattr(fetch, "CHUNK", 64 * 1024)
    monkeypatch.setattr(fetch, "PROGRESS_EVERY_SECONDS", 0)
    monkeypatch.setattr(fetch, "_set_file", lambda job, i, **c: (progress.append(c.get("done_bytes")),
                                                                 original(job, i, **c)))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        job = fetch.start(ADMIN, FetchRequest(repo="acme/Tiny-GGUF"))
    assert len(callbacks) == 1  # handed to the worker only once the row exists
    assert [f["path"] for f in job.files] == ["tiny-Q4_K_M.gguf"] and len(job.commit) == 40
    job = fetch.run(job)
    assert job.status == "done", job.log
    assert job.files[0]["state"] == "verified" and job.files[0]["done_bytes"] == len(model_bytes)
    seen = [p for p in progress if p]
    assert len(seen) > 2 and seen == sorted(seen)  # progress was written while it downloaded
    entry = ModelEntry.objects.get(name="tiny")
    assert entry.source_revision == job.commit and entry.quantisation == "Q4_K_M" and entry.architecture == "llama"
    record = entry.files.get()
    assert record.verified and not record.quarantined
    assert record.sha256 == hashlib.sha256(model_bytes).hexdigest()
    assert f"/hub/acme/Tiny-GGUF/{job.commit}/" in record.path
    assert len(entry.fingerprint) == 16


def test_a_corrupted_file_is_caught_by_its_hash_and_quarantined(hub, mirror_root, model_bytes):
    repo = hub.add("acme/Bad-GGUF", {"bad-Q4_K_M.gguf": model_bytes})
    damaged = bytearray(model_bytes)
    damaged[-10] ^= 0xFF
    repo.lies["bad-Q4_K_M.gguf"] = bytes(damaged)
    job = fetched(FetchRequest(repo="acme/Bad-GGUF"))
    assert job.status == "failed" and "SHA-256 differs" in job.error
    assert job.files[0]["state"] == "quarantined"
    record = ModelFile.objects.get()
    assert record.quarantined and not record.verified and "/.quarantine/" in record.path
    assert not ModelEntry.objects.exists()  # nothing reached the catalog
    assert not list((mirror_root / "hub").rglob("*.gguf"))


def test_an_interrupted_fetch_resumes_where_it_stopped(hub, mirror_root, model_bytes):
    repo = hub.add("acme/Slow-GGUF", {"slow-Q4_K_M.gguf": model_bytes})
    cut = repo.cut_after["slow-Q4_K_M.gguf"] = len(model_bytes) // 2
    job = fetched(FetchRequest(repo="acme/Slow-GGUF"))
    assert job.status == "failed" and "resume" in job.error
    half = job.files[0]["done_bytes"]
    assert 0 < half < len(model_bytes)
    job = fetch.run(fetch.resume(ADMIN, job, enqueue=False))
    assert job.status == "done", job.log
    assert hub.ranges("slow-Q4_K_M.gguf") == [f"bytes={half}-"]
    assert hub.bytes_served["slow-Q4_K_M.gguf"] == cut + len(model_bytes) - half  # only the rest, the second time
    assert ModelFile.objects.get().verified


@pytest.mark.parametrize("options, files, reason", [
    ({"gated": True}, {"m-Q4_K_M.gguf": b"x"}, "gated"),
    ({}, {"pytorch_model.bin": b"x", "config.json": b"{}"}, "pickle_only"),
    ({"tags": ["custom_code"]}, {"model.safetensors": b"x"}, "remote_code"),
    ({"config": {"auto_map": {"AutoModel": "modeling.M"}}}, {"model.safetensors": b"x"}, "remote_code"),
])
def test_refused_before_downloading(hub, mirror_root, options, files, reason):
    hub.add("acme/Refused", files, **options)
    with pytest.raises(FetchRefused) as refused:
        fetch.start(ADMIN, FetchRequest(repo="acme/Refused"), enqueue=False)
    assert refused.value.details["reason"] == reason
    assert not FetchJob.objects.exists()
    assert not [r for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]]


def test_a_gated_repository_is_fetched_with_a_token_that_was_granted(hub, mirror_root, model_bytes, monkeypatch):
    hub.add("acme/Granted-GGUF", {"g-Q4_K_M.gguf": model_bytes}, gated=True, allowed_tokens=("hf_granted",))
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert fetched(FetchRequest(repo="acme/Granted-GGUF")).status == "done"


def test_not_enough_disk_is_refused_with_the_figures(hub, mirror_root, model_bytes, monkeypatch):
    hub.add("acme/Huge-GGUF", {"huge-Q4_K_M.gguf": model_bytes})
    monkeypatch.setattr(fetch, "free_bytes", lambda path: 1000)
    with pytest.raises(FetchRefused) as refused:
        fetch.start(ADMIN, FetchRequest(repo="acme/Huge-GGUF"), enqueue=False)
    assert refused.value.details["reason"] == "disk" and "1,000 are free" in refused.value.message


def test_revision_pinning_fetches_the_commit_asked_for_not_the_branch(hub, mirror_root, model_bytes, tmp_path):
    newer = write_gguf(tmp_path / "new.gguf", ModelShape(layers=2, embedding=64), seed=1).read_bytes()
    hub.add("acme/Moving-GGUF", {"moving-Q4_K_M.gguf": model_bytes})
    first = hub.repos["acme/Moving-GGUF"].commits[0].sha
    second = hub.add_commit("acme/Moving-GGUF", {"moving-Q4_K_M.gguf": newer})
    old = fetched(FetchRequest(repo="acme/Moving-GGUF", revision=first, name="moving-old"))
    new = fetched(FetchRequest(repo="acme/Moving-GGUF", revision="main", name="moving"))
    assert (old.commit, new.commit) == (first, second)
    assert ModelEntry.objects.get(name="moving-old").source_revision == first
    assert ModelEntry.objects.get(name="moving").source_revision == second
    held = {f.path.split("/")[-2]: f.sha256 for f in ModelFile.objects.all()}
    assert held == {first: hashlib.sha256(model_bytes).hexdigest(), second: hashlib.sha256(newer).hexdigest()}


def test_a_member_fetches_into_their_project_and_an_outsider_is_refused(hub, mirror_root, model_bytes, personas):
    from berth.errors import NotFound

    hub.add("acme/Team-GGUF", {"team-Q4_K_M.gguf": model_bytes})
    ml = personas.acme.team
    job = fetched(FetchRequest(repo="acme/Team-GGUF", owner=ml), actor=Actor(user=personas.max))
    assert job.status == "done" and ModelEntry.objects.get(name="team").owner == ml
    with pytest.raises(NotFound):
        fetch.start(Actor(user=personas.oscar), FetchRequest(repo="acme/Team-GGUF", owner=ml), enqueue=False)
