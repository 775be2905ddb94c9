"""The llama.cpp engine build: cached by version, verified, and a failure names its step."""

from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduler.models import NodeEngine
from serving import services
from serving.engines import build_llamacpp

pytestmark = pytest.mark.django_db


def test_cached_build_is_reused_and_reports_its_version(llama_server_binary):
    lines = []
    engine = build_llamacpp.build(Path(settings.ENGINE_CACHE_DIR), progress=lambda s, m: lines.append((s, m)))
    assert engine.reused and engine.path == llama_server_binary
    assert engine.source == f"llama-cpp-python=={build_llamacpp.SDIST_VERSION}"
    assert engine.version == build_llamacpp.read_version(engine.path)
    assert lines and lines[0][0] == "install" and "reusing" in lines[0][1]


def test_cache_lives_outside_the_work_tree():
    assert not Path(settings.ENGINE_CACHE_DIR).resolve().is_relative_to(settings.BASE_DIR)


def test_command_records_the_engine_on_this_node(llama_server_binary, capsys):
    node = services.register_local_node()
    node.engines.all().delete()
    call_command("engines", "build", "llamacpp")
    engine = NodeEngine.objects.get(node=node, kind="llamacpp")
    assert engine.state == NodeEngine.State.READY
    assert engine.version == build_llamacpp.read_version(llama_server_binary)
    assert "reused" in capsys.readouterr().out


def test_tampered_download_fails_at_its_step_and_keeps_the_log(tmp_path, monkeypatch):
    # The package index is a stand-in here: it serves bytes that are not the pinned sdist.
    monkeypatch.setattr(build_llamacpp, "_download", lambda dest: dest.write_bytes(b"not the sdist"))
    with pytest.raises(build_llamacpp.BuildError) as failure:
        build_llamacpp.build(tmp_path)
    assert failure.value.step == "download"
    assert "SHA-256" in str(failure.value)
    assert failure.value.log_path.is_file()
    assert build_llamacpp.installed(tmp_path) is None  # nothing half-built was installed


def test_command_failure_is_a_clear_error(tmp_path, monkeypatch, settings):
    settings.ENGINE_CACHE_DIR = tmp_path
    monkeypatch.setattr(build_llamacpp, "_download", lambda dest: (_ for _ in ()).throw(OSError("index unreachable")))
    with pytest.raises(CommandError, match="failed at step 'download': index unreachable"):
        call_command("engines", "build", "llamacpp")
