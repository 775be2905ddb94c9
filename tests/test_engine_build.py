"""The llama.cpp engine build: cached by version, verified, and a failure names its step."""

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduler.models import NodeEngine
from serving.node import registration as services
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


SDIST_FILE = f"llama_cpp_python-{build_llamacpp.SDIST_VERSION}.tar.gz"

# A build backend inside the fake sdist: pip prepares an sdist's metadata even for `pip download`,
# and this one needs nothing installed, so the whole download stays on this machine.
FAKE_BACKEND = f'''
import os
def get_requires_for_build_wheel(config_settings=None):
    return []
def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = "llama_cpp_python-{build_llamacpp.SDIST_VERSION}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info))
    with open(os.path.join(metadata_directory, info, "METADATA"), "w") as out:
        out.write("Metadata-Version: 2.1\\nName: llama-cpp-python\\nVersion: {build_llamacpp.SDIST_VERSION}\\n")
    return info
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("a download never builds")
'''


@pytest.fixture
def package_index(tmp_path, monkeypatch):
    """Factory: a local file:// package index that pip is pointed at the way a site points it at its
    mirror (PIP_INDEX_URL), holding a fake llama-cpp-python sdist or nothing; returns the sdist."""

    def make(with_sdist: bool = True) -> Path | None:
        index = tmp_path / "index"
        project = index / "llama-cpp-python"
        project.mkdir(parents=True)
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # not this machine's pip.conf
        for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
            monkeypatch.setenv(name, "")
        for name in ("PIP_NO_INDEX", "PIP_CONSTRAINT", "PIP_REQUIRE_HASHES", "PIP_ONLY_BINARY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
        if not with_sdist:
            (project / "index.html").write_text("<!DOCTYPE html><html><body></body></html>\n")
            return None
        sdist = project / SDIST_FILE
        root = SDIST_FILE.removesuffix(".tar.gz")
        members = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                     'backend-path = ["."]\n',
                   "backend.py": FAKE_BACKEND}
        with tarfile.open(sdist, "w:gz") as archive:
            for name, text in members.items():
                data = text.encode()
                member = tarfile.TarInfo(f"{root}/{name}")
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        (project / "index.html").write_text(
            f'<!DOCTYPE html><html><body><a href="{SDIST_FILE}#sha256={digest}">{SDIST_FILE}</a></body></html>\n')
        return sdist

    return make


def test_sdist_comes_from_the_sites_index_and_a_wrong_hash_names_both(package_index, tmp_path):
    fake = package_index()
    cache = tmp_path / "cache"
    with pytest.raises(build_llamacpp.BuildError) as failure:
        build_llamacpp.build(cache)
    fake_sha256 = hashlib.sha256(fake.read_bytes()).hexdigest()
    assert failure.value.step == "download"
    assert fake_sha256 in str(failure.value) and build_llamacpp.SDIST_SHA256 in str(failure.value)
    log = failure.value.log_path.read_text()
    assert "-m pip download --no-binary llama-cpp-python --no-deps" in log
    assert f"Looking in indexes: {(tmp_path / 'index').as_uri()}" in log  # pip used the site's index
    assert not list((cache / "llamacpp").rglob(SDIST_FILE))  # the wrong file is not kept for a rerun
    assert build_llamacpp.installed(cache) is None  # nothing half-built was installed


def test_sdist_with_the_pinned_hash_goes_on_to_extract(package_index, tmp_path, monkeypatch):
    fake = package_index()
    monkeypatch.setattr(build_llamacpp, "SDIST_SHA256", hashlib.sha256(fake.read_bytes()).hexdigest())
    with pytest.raises(build_llamacpp.BuildError) as failure:
        build_llamacpp.build(tmp_path / "cache")
    assert failure.value.step == "extract"  # the download passed; the fake holds no llama.cpp tree
    assert "no vendor/llama.cpp tree" in str(failure.value)


def test_pip_failure_fails_at_download_with_pips_output_in_the_log(package_index, tmp_path):
    package_index(with_sdist=False)
    with pytest.raises(build_llamacpp.BuildError) as failure:
        build_llamacpp.build(tmp_path / "cache")
    assert failure.value.step == "download"
    assert f"`pip download llama-cpp-python=={build_llamacpp.SDIST_VERSION}` exited 1" in str(failure.value)
    assert "No matching distribution found" in str(failure.value)
    assert "No matching distribution found for llama-cpp-python" in failure.value.log_path.read_text()


def test_command_failure_is_a_clear_error(package_index, tmp_path, settings):
    package_index(with_sdist=False)
    settings.ENGINE_CACHE_DIR = tmp_path / "cache"
    with pytest.raises(CommandError, match=r"failed at step 'download': `pip download llama-cpp-python==.*"
                                           r"No matching distribution found"):
        call_command("engines", "build", "llamacpp")
