"""Gateway fixtures: real uvicorn gateway processes on loopback, real llama-server replicas, keys made
through Tenancy's services, and the routing rows a deployment would leave (by hand until Serving's
deployments land)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
import uuid
from pathlib import Path

import httpx
import pytest
from django.db import connection

from berth.web import uvicorn_command

from serving import events
from serving.control import routing
from serving.keys import replica_key
from tests.assets.database import database_environ
from tests.assets.llama_server import LlamaServer, free_port
from tests.assets.otlp_receiver import OtlpReceiver
from tests.assets.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.llama  # the engine fixtures below start llama-server


class GatewayProcess:
    """``uvicorn berth.asgi:application`` as its own process, stopped by its PID. ``settings`` are
    ``BERTH_GATEWAY_*`` values; ``environ`` overrides any other variable (``REDIS_URL=""``: embedded)."""

    def __init__(self, log_path: Path, environ: dict | None = None, **settings):
        db = connection.settings_dict
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, **database_environ(db),
                   BERTH_GATEWAY_AUTH_CACHE_SECONDS="30", BERTH_GATEWAY_ROUTING_TTL_MS="200",
                   BERTH_GATEWAY_USAGE_FLUSH_MS="100", BERTH_LOG_LEVEL="INFO")
        env.update({f"BERTH_GATEWAY_{name.upper()}": str(value) for name, value in settings.items()})
        env.update(environ or {})
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            uvicorn_command("127.0.0.1", self.port, "--loop", "uvloop", "--http", "httptools", "--no-access-log"),
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

        def up():
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log()[-3000:]}")
            try:
                return httpx.get(f"{self.base_url}/v1/models", timeout=2).status_code == 401
            except httpx.HTTPError:
                return False

        wait_until(up, 60, what="the gateway answering on /v1/")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai(self, key: str, **options):
        import openai

        return openai.OpenAI(api_key=key, base_url=f"{self.base_url}/v1", max_retries=0, timeout=120, **options)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker, artifacts_dir):
    with django_db_blocker.unblock():
        process = GatewayProcess(artifacts_dir / "gateway-a.log", admission_timeout=60)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def gateway_b(django_db_setup, django_db_blocker, artifacts_dir):
    """A second process sharing the database and Redis, with a short admission timeout."""
    with django_db_blocker.unblock():
        process = GatewayProcess(artifacts_dir / "gateway-b.log", admission_timeout=2, admission_queue=1)
    yield process
    process.stop()


# Replicas: the engine key derives from the replica's id, so the id is fixed before the engine starts.

def _engine(binary, model, log_path, replica_id, **options) -> LlamaServer:
    server = LlamaServer(binary, model, log_path, api_key=replica_key(replica_id), threads=1, **options)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def chat_engine(llama_server_binary, smollm2_model, artifacts_dir):
    replica_id = str(uuid.uuid4())
    server = _engine(llama_server_binary, smollm2_model, artifacts_dir / "gw-smollm2.log", replica_id, context=2048,
                     parallel=2)
    yield types.SimpleNamespace(server=server, replica_id=replica_id)
    server.stop()


@pytest.fixture(scope="session")
def tiny_engine(llama_server_binary, tiny_model, artifacts_dir):
    replica_id = str(uuid.uuid4())
    server = _engine(llama_server_binary, tiny_model, artifacts_dir / "gw-tiny.log", replica_id, parallel=4)
    yield types.SimpleNamespace(server=server, replica_id=replica_id)
    server.stop()


@pytest.fixture(scope="session")
def embedding_engine(llama_server_binary, tiny_model, artifacts_dir):
    replica_id = str(uuid.uuid4())
    server = _engine(llama_server_binary, tiny_model, artifacts_dir / "gw-embed.log", replica_id,
                     extra=("--embeddings", "--pooling", "mean"))
    yield types.SimpleNamespace(server=server, replica_id=replica_id)
    server.stop()


@pytest.fixture
def receiver():
    """A trace collector's OTLP/HTTP endpoint on loopback (``tests.assets.otlp_receiver``)."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture
def node(transactional_db):
    from scheduler.services import NodeReport, register_node

    return register_node(NodeReport(name="gw-node", address="127.0.0.1"))


@pytest.fixture
def deploy(node):
    """``deploy(name, engine=None, task="chat", state="ready", replica_state="ready", replica_id=None,
    port=None)``: the Deployment and Replica rows Serving would keep for a running engine."""
    from serving.models import Deployment, Replica

    def make(name, engine=None, *, task="chat", state="ready", replica_state="ready", replica_id=None, port=None):
        slots = getattr(getattr(engine, "server", None), "parallel", None)
        deployment = Deployment.objects.create(name=name, task=task, model_path="/models/x.gguf", node=node,
                                               state=state, config={"parallel": slots} if slots else {})
        replica = None
        if engine is not None or replica_id is not None:
            replica = Replica.objects.create(
                public_id=replica_id or engine.replica_id, deployment=deployment, node=node,
                port=port or engine.server.port, state=replica_state)
        events.routing_changed()  # what Serving does after every routing change
        return types.SimpleNamespace(deployment=deployment, replica=replica)

    return make


@pytest.fixture
def tree(transactional_db):
    """A fresh org/team/project of unique slugs (so Redis counters never carry over between tests)."""
    from tenancy.audit import Actor
    from tenancy.services.tree import create_scope

    actor = Actor(system="tests")
    slug = "o" + uuid.uuid4().hex[:10]
    org = create_scope(actor, "org", slug, "Org")
    team = create_scope(actor, "team", "ml", "ML", org)
    project = create_scope(actor, "project", "search", "Search", team)
    return types.SimpleNamespace(org=org, team=team, project=project, actor=actor)


@pytest.fixture
def make_key(tree):
    """``make_key(**client_fields)``: a fresh client of the tree's project and one key of it."""
    from tenancy.services import clients

    counter = iter(range(1, 10_000))

    def make(project=None, **fields):
        fields.setdefault("all_models", True)
        fields.setdefault("access", "inference")
        client = clients.create_client(tree.actor, project or tree.project, f"app-{next(counter)}", **fields)
        credential, plaintext = clients.create_credential(tree.actor, client)
        return types.SimpleNamespace(client=client, credential=credential, key=plaintext)

    return make
