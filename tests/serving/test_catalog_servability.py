"""Servability: a GGUF model's architecture against what the installed llama.cpp knows — checked
against a real llama-server loading a model of a known and of an unknown architecture."""

from __future__ import annotations

import pytest

from serving.catalog import servability
from tests.assets.gguf_models import ModelShape, write_gguf
from tests.assets.llama_server import LlamaServer
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.llama]


def test_the_embedded_names_are_in_the_installed_binary(llama_server_binary):
    found = servability.architectures_in_binary(str(llama_server_binary))
    assert {"llama", "qwen3", "gemma2", "phi3"} <= found
    data = llama_server_binary.read_bytes()
    # Names folded into a longer one (qwen2 inside rwkv6qwen2) are still there, as a suffix.
    assert all(name.encode() + b"\0" in data for name in servability.KNOWN_LLAMACPP)


def test_known_architecture_is_servable_with_an_estimate(tmp_path, llama_server_binary):
    model = write_gguf(tmp_path / "known.gguf", ModelShape(architecture="llama"))
    verdict = servability.check(model, profile={"engine": "llamacpp", "context": 512})
    assert verdict.servable and verdict.architecture == "llama" and verdict.estimate["total_bytes"] > 0
    assert verdict.estimate["breakdown"]["inputs"]["ctx_size"] == 512
    server = LlamaServer(llama_server_binary, model, tmp_path / "known.log")
    try:
        server.wait_ready()  # and llama.cpp agrees
    finally:
        server.stop()


def test_unknown_architecture_is_refused_as_llama_server_would(tmp_path, llama_server_binary):
    model = write_gguf(tmp_path / "unknown.gguf", ModelShape(architecture="berthnet"))
    verdict = servability.check(model)
    assert not verdict.servable and verdict.architecture == "berthnet" and "berthnet" in verdict.reason
    server = LlamaServer(llama_server_binary, model, tmp_path / "unknown.log")
    try:
        wait_until(lambda: server.process.poll() is not None, 60, what="llama-server to refuse the model")
        assert "unknown model architecture" in server.log_tail(20000)
    finally:
        server.stop()


# --- a file cut short -------------------------------------------------------------------------------

def cut_short(whole, target, keep: int):
    target.write_bytes(whole.read_bytes()[:keep])
    return target


@pytest.mark.parametrize("cut", ["a few bytes", "a third"])
def test_a_truncated_gguf_is_not_servable_and_the_reason_names_both_sizes(tmp_path, cut):
    whole = write_gguf(tmp_path / "whole.gguf", ModelShape())
    size = whole.stat().st_size
    keep = size - 3 if cut == "a few bytes" else size - size // 3
    model = cut_short(whole, tmp_path / "cut.gguf", keep)
    verdict = servability.check(model, profile={"engine": "llamacpp", "context": 512})
    assert not verdict.servable and verdict.architecture == "llama" and verdict.estimate is None
    assert f"ends at byte {size:,}" in verdict.reason and f"the file has {keep:,} bytes" in verdict.reason
    assert f"({size - keep:,} missing)" in verdict.reason
    assert servability.check(whole).servable  # the same model whole


def test_llama_server_refuses_a_gguf_three_bytes_short_as_servability_does(tmp_path, llama_server_binary):
    whole = write_gguf(tmp_path / "whole.gguf", ModelShape())
    model = cut_short(whole, tmp_path / "cut.gguf", whole.stat().st_size - 3)
    assert not servability.check(model).servable
    server = LlamaServer(llama_server_binary, model, tmp_path / "cut.log")
    try:
        wait_until(lambda: server.process.poll() is not None, 60, what="llama-server to refuse the file")
        assert "not within the file bounds" in server.log_tail(20000)
    finally:
        server.stop()


def test_an_always_on_catalog_model_cut_short_is_not_launched(tmp_path, settings, monkeypatch):
    """Placement asks servability: a truncated file is never launched (five doomed launches and a
    park were what followed); the whole file is."""
    import dataclasses

    from django.core.cache import cache

    from scheduler.services import register_node
    from serving import queues
    from serving.catalog.entries import import_local
    from serving.control import placement
    from serving.models import ModelEntry
    from serving.node.discovery import local_node_report
    from tenancy.audit import Actor

    cache.clear()
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    register_node(dataclasses.replace(local_node_report(), name="cut-node"))
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)
    whole = write_gguf(tmp_path / "whole.gguf", ModelShape())
    for name, source in (("cut", cut_short(whole, tmp_path / "cut.gguf", whole.stat().st_size * 2 // 3)),
                         ("whole", whole)):
        entry = import_local(Actor(system="tests"), source, name=name)
        ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1,
                                                      profiles=[{**entry.profiles[0], "context": 256}])
    assert placement.reconcile()["launched"] == ["whole"]
