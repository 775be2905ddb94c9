"""Fixtures shared by the whole suite: personas, generated models, a real llama-server."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from django.conf import settings

from serving.engines import build_llamacpp
from tests.assets.gguf_models import ModelShape, write_gguf
from tests.assets.llama_server import LlamaServer
from tests.assets.personas import personas  # noqa: F401  (a fixture for every area)
from tests.assets.smollm2 import smollm2_path
from tests.assets.tcp_proxy import TcpProxy

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

# What also runs on the embedded default a newcomer meets first (SQLite, the file broker, no Redis):
# `make test` runs these a second time that way (`-m embedded`). Paths under tests/.
EMBEDDED = (
    "tenancy/test_keys.py", "tenancy/test_api_clients.py", "tenancy/test_console_keys.py",
    "gateway/test_inference.py", "gateway/test_console_playground.py", "gateway/test_batch_console.py",
    "serving/test_catalog_entries.py", "serving/test_catalog_room.py", "serving/test_catalog_room_portable.py",
    "serving/test_catalog_servability.py", "serving/test_mirror_pages.py", "scheduler/test_hardening.py",
    "serving/test_quarantine_and_states.py", "serving/test_reconcile_soon.py", "scheduler/test_decision_filters.py",
    "tenancy/test_audit_filters.py", "tenancy/test_console_bases.py",
    "test_console.py", "test_console_walk.py", "test_persona_walk.py", "test_query_counts.py",
    "test_backup.py", "test_dashboard.py", "test_newcomer_journey.py", "test_console_crawl.py", "test_breadcrumbs.py",
)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent
    embedded = {root / path for path in EMBEDDED}
    missing = [path for path in EMBEDDED if not (root / path).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py EMBEDDED names files that are gone: {missing}")
    for item in items:
        if Path(item.fspath) in embedded:
            item.add_marker(pytest.mark.embedded)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Where tests leave what a person may want to look at (screenshots, engine logs)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The cached llama-server that `make test` builds before pytest starts."""
    engine = build_llamacpp.installed(Path(settings.ENGINE_CACHE_DIR))
    if engine is None:
        pytest.fail("llama-server is not built: run `make test` (or `python -m serving.engines.build_llamacpp`).")
    return engine.path


@pytest.fixture
def gguf_model(tmp_path):
    """Factory: ``gguf_model(layers=4, kv_heads=2, ...)`` writes a real model of that shape."""

    def make(name: str = "model.gguf", **shape) -> Path:
        return write_gguf(tmp_path / name, ModelShape(**shape))

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", ModelShape())


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    return smollm2_path()


def _start(binary: Path, model: Path, log_dir: Path, **options):
    server = LlamaServer(binary, model, log_dir / f"llama-server-{model.stem}.log", **options)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def llama_server(llama_server_binary, tiny_model, artifacts_dir):
    """A real llama-server serving a generated tiny model, for the whole session."""
    server = _start(llama_server_binary, tiny_model, artifacts_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server(llama_server_binary, smollm2_model, artifacts_dir):
    """A real llama-server serving SmolLM2-135M-Instruct (a real chat model), behind an API key."""
    server = _start(llama_server_binary, smollm2_model, artifacts_dir, context=2048, api_key="test-engine-key")
    yield server
    server.stop()


@pytest.fixture
def argon2_hashing(settings):
    """Berth's own password hashers (Argon2 first), for the tests that are about them: tests/settings.py
    puts a cheap hasher first for everyone else. Taken from berth.settings, not written again here, so
    these tests still check what production hashes with."""
    from berth import settings as berth_settings

    settings.PASSWORD_HASHERS = list(berth_settings.PASSWORD_HASHERS)
    return settings


@pytest.fixture
def admin_password() -> str:
    return "correct-horse-battery-staple"


@pytest.fixture
def admin_user(django_user_model, admin_password):
    return django_user_model.objects.create_superuser("ada", "ada@example.org", admin_password)


@pytest.fixture
def chromium_path() -> str:
    path = os.environ.get("BERTH_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        pytest.fail(f"Chromium is not at {path}: `make test` installs it (apt-get install chromium).")
    return path


@pytest.fixture
def database_proxy():
    """A TCP proxy in front of the suite's PostgreSQL test database, for a process the test starts
    (``tests.assets.database.through(proxy)``: its database setting); the test cuts it (``refuse()``)
    and restores it, while the test itself still reaches the database directly."""
    from django.db import connection

    db = connection.settings_dict
    proxy = TcpProxy(int(db["PORT"] or 5432), db["HOST"] or "127.0.0.1")
    yield proxy
    proxy.close()
