"""A model reference must be a whole model file under an allowed root; links may not lead out."""

from __future__ import annotations

import os

import pytest

from serving.engines.llamacpp import LlamaCpp
from serving.engines.model_files import validate_model_path
from serving.engines.vllm import VLLM
from serving.errors import ModelNotAllowed


@pytest.fixture
def roots(tmp_path):
    allowed = tmp_path / "models"
    allowed.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    return allowed, outside


def reason(path, roots, **kwargs):
    with pytest.raises(ModelNotAllowed) as caught:
        validate_model_path(path, roots, **kwargs)
    assert caught.value.code == "model_not_allowed"
    return caught.value.details["reason"]


def test_a_gguf_file_under_an_allowed_root_is_accepted(roots, gguf_model):
    allowed, _ = roots
    model = gguf_model()
    target = allowed / "tiny.gguf"
    os.link(model, target)

    assert validate_model_path(str(target), [allowed]) == target.resolve()


def test_a_file_outside_every_root_is_refused(roots, gguf_model):
    allowed, outside = roots
    model = outside / "m.gguf"
    model.write_bytes(gguf_model().read_bytes())

    assert reason(str(model), [allowed]) == "outside_roots"
    assert reason(str(allowed / ".." / "elsewhere" / "m.gguf"), [allowed]) == "outside_roots"


def test_a_missing_file_is_refused(roots):
    allowed, _ = roots
    assert reason(str(allowed / "absent.gguf"), [allowed]) == "missing"


def test_a_link_leading_out_of_the_root_is_refused(roots, gguf_model):
    allowed, outside = roots
    real = outside / "m.gguf"
    real.write_bytes(gguf_model().read_bytes())
    (allowed / "link.gguf").symlink_to(real)
    (allowed / "dir-link").symlink_to(outside)

    assert reason(str(allowed / "link.gguf"), [allowed]) == "symlink_escape"
    assert reason(str(allowed / "dir-link" / "m.gguf"), [allowed]) == "symlink_escape"


def test_a_link_that_stays_inside_the_root_is_accepted(roots, gguf_model):
    allowed, _ = roots
    real = allowed / "sub" / "m.gguf"
    real.parent.mkdir()
    real.write_bytes(gguf_model().read_bytes())
    (allowed / "current.gguf").symlink_to(real)

    assert validate_model_path(str(allowed / "current.gguf"), [allowed]) == real.resolve()


def test_a_file_that_is_not_gguf_is_refused_for_llamacpp(roots):
    allowed, _ = roots
    fake = allowed / "model.gguf"
    fake.write_bytes(b"<html>not a model</html>")

    assert reason(str(fake), [allowed]) == "not_gguf"
    with pytest.raises(ModelNotAllowed):
        LlamaCpp(binary="/nonexistent/llama-server").validate_model(str(fake), [allowed])


def test_a_relative_path_and_a_directory_are_refused_for_llamacpp(roots):
    allowed, _ = roots
    assert reason("models/m.gguf", [allowed]) == "not_absolute"
    assert reason(str(allowed), [allowed]) == "not_a_file"


def test_a_split_gguf_needs_every_part(roots, gguf_model):
    allowed, _ = roots
    data = gguf_model().read_bytes()
    (allowed / "big-00001-of-00002.gguf").write_bytes(data)

    assert reason(str(allowed / "big-00001-of-00002.gguf"), [allowed]) == "incomplete"
    (allowed / "big-00002-of-00002.gguf").write_bytes(data)
    assert validate_model_path(str(allowed / "big-00001-of-00002.gguf"), [allowed])


def test_vllm_takes_a_complete_model_directory(roots):
    allowed, _ = roots
    repo = allowed / "qwen"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    engine = VLLM()

    with pytest.raises(ModelNotAllowed) as caught:
        engine.validate_model(str(repo), [allowed])
    assert caught.value.details["reason"] == "not_a_model_directory"

    (repo / "model.safetensors.incomplete").write_bytes(b"")
    (repo / "model-00001.safetensors").write_bytes(b"x")
    with pytest.raises(ModelNotAllowed) as caught:
        engine.validate_model(str(repo), [allowed])
    assert caught.value.details["reason"] == "incomplete"

    (repo / "model.safetensors.incomplete").unlink()
    assert engine.validate_model(str(repo), [allowed]) == repo.resolve()


def test_settings_roots_are_used_when_none_are_given(settings, tmp_path, gguf_model):
    model = gguf_model()
    settings.SCHEDULER_MODEL_ROOTS = [model.parent]
    assert validate_model_path(str(model)) == model.resolve()
    settings.SCHEDULER_MODEL_ROOTS = [tmp_path / "nowhere"]
    assert reason(str(model), None) == "outside_roots"
