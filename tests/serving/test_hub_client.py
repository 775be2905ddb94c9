"""The hub as the mirror reads it: the real huggingface_hub client against the local hub server."""

from __future__ import annotations

import pytest

from serving.catalog import hub as hub_client
from serving.catalog.errors import HubUnreachable, NoMatchingFiles, RepositoryNotFound
from tests.assets.gguf_models import ModelShape, write_gguf
from tests.assets.hub_server import HubServer, hub, mirror_root, sha256  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db  # the estimate reads calibration rows


def gguf_bytes(tmp_path, name="m.gguf", **shape) -> bytes:
    return write_gguf(tmp_path / name, ModelShape(**shape)).read_bytes()


def test_search_lists_downloads_task_license_and_gated(hub):
    hub.add("acme/Tiny-GGUF", {"tiny-Q4_K_M.gguf": b"x" * 100}, downloads=50, license="mit")
    hub.add("acme/Tiny-Gated", {"w.safetensors": b"x" * 100}, gated=True, downloads=7)
    hub.add("other/Unrelated", {"w.safetensors": b"x"})
    results = hub_client.search("tiny")
    assert [r["repo"] for r in results] == ["acme/Tiny-GGUF", "acme/Tiny-Gated"]
    first, second = results
    assert first["downloads"] == 50 and first["license"] == "mit" and first["task"] == "text-generation"
    assert first["gated"] is False and second["gated"] is True


def test_files_are_grouped_by_quantisation_with_sizes_and_shards_together(hub):
    hub.add("acme/Big-GGUF", {
        "Big-Q4_K_M.gguf": b"a" * 300, "Big-Q8_0-00001-of-00002.gguf": b"b" * 200,
        "Big-Q8_0-00002-of-00002.gguf": b"c" * 100, "mmproj-Big-f16.gguf": b"d" * 10,
        "Big.imatrix.gguf": b"e" * 10, "README.md": b"hello"})
    repo = hub_client.repository("acme/Big-GGUF")
    assert len(repo.commit) == 40
    sets = {s.name: s for s in repo.file_sets()}
    assert set(sets) == {"Big-Q4_K_M", "Big-Q8_0"}
    assert sets["Big-Q8_0"].size == 300 and len(sets["Big-Q8_0"].files) == 2
    assert sets["Big-Q4_K_M"].quantisation == "Q4_K_M"
    big = next(f for f in repo.files if f.path == "Big-Q4_K_M.gguf")
    assert big.sha256 == sha256(b"a" * 300) and big.size == 300


def test_quantisation_choice_defaults_to_q4_k_m_and_names_the_alternatives(hub):
    hub.add("acme/Q-GGUF", {"q-Q4_K_M.gguf": b"1", "q-Q8_0.gguf": b"2", "q-Q4_K_M-00001-of-00002.gguf": b"3",
                            "q-Q4_K_M-00002-of-00002.gguf": b"4"})
    files = hub_client.repository("acme/Q-GGUF").files
    assert hub_client.choose_set(files).name == "q-Q4_K_M"  # the joined copy over the split one
    assert hub_client.choose_set(files, quant="q8_0").name == "q-Q8_0"
    assert hub_client.choose_set(files, file="q-Q8_0.gguf").name == "q-Q8_0"
    with pytest.raises(NoMatchingFiles) as refused:
        hub_client.choose_set(files, quant="Q2_K")
    assert "q-Q8_0" in refused.value.message


def test_gguf_estimate_reads_only_the_header_with_range_requests(hub, tmp_path, mirror_root):
    data = gguf_bytes(tmp_path, layers=8, embedding=256, heads=4, kv_heads=2, feed_forward=1024)
    hub.add("acme/Est-GGUF", {"est-F16.gguf": data})
    repo = hub_client.repository("acme/Est-GGUF")
    result = hub_client.remote_estimate(repo.repo, repo.commit, repo.files[0], context=512)
    assert result["architecture"] == "llama" and result["total_bytes"] > len(data) // 2
    assert hub.ranges("est-F16.gguf") and all(r.startswith("bytes=") for r in hub.ranges("est-F16.gguf"))
    assert hub.bytes_served["est-F16.gguf"] < len(data) // 4  # the weights never travelled


def test_unknown_repository_and_unreachable_hub_are_named(hub, monkeypatch):
    with pytest.raises(RepositoryNotFound):
        hub_client.repository("acme/nothing-here")
    gone = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", gone.url)
    gone.stop()
    with pytest.raises(HubUnreachable) as unreachable:
        hub_client.search("anything")
    assert "unreachable" in unreachable.value.message
