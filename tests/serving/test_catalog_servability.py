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
