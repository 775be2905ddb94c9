"""Serving's fixtures: launch specs, runtimes that clean up after themselves, a model directory, and
a real node agent with this machine registered under its node name."""

from __future__ import annotations

import dataclasses
import secrets
import uuid

import pytest

from serving.engines.base import LaunchSpec
from serving.runtimes.process import ProcessRuntime
from tests.assets.agent import NODE, Agent
from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until


@pytest.fixture
def launch_spec():
    """Factory: ``launch_spec(model_path, **overrides)`` → a LaunchSpec on a free loopback port."""

    def make(model_path, **overrides) -> LaunchSpec:
        fields = dict(replica_id=f"r-{uuid.uuid4().hex[:12]}", engine="llamacpp", model_path=str(model_path),
                      served_name="berth-test", host="127.0.0.1", port=free_port(),
                      api_key=f"bre_test_{secrets.token_hex(8)}", config={"context": 512}, cores=1)
        fields.update(overrides)
        return LaunchSpec(**fields)

    return make


@pytest.fixture
def process_runtime(tmp_path):
    """A process runtime with its own engines directory; whatever it still runs is stopped after."""
    runtime = ProcessRuntime(tmp_path / "engines")
    yield runtime
    for handle in ProcessRuntime(tmp_path / "engines").managed():
        runtime.stop(handle, grace_seconds=5)


@pytest.fixture
def docker_client():
    import docker

    client = docker.from_env()  # DOCKER_HOST: the daemon the test command started (no bridge)
    yield client
    client.close()


@pytest.fixture
def docker_runtime(docker_client):
    """A Docker runtime (pulling off); every container it started in the test is removed after."""
    from serving.runtimes.docker import DockerRuntime

    runtime = DockerRuntime(client=docker_client, allow_pull=False)
    started = []
    original_start = runtime.start

    def start(spec, command):
        handle = original_start(spec, command)
        started.append(handle)
        return handle

    runtime.start = start
    yield runtime
    for handle in started:
        runtime.stop(handle, grace_seconds=2)


@pytest.fixture(scope="session")
def llamacpp_image():
    """The local llama.cpp image the test command builds before pytest."""
    import docker
    import docker.errors

    from serving.engines.llamacpp_image import IMAGE

    client = docker.from_env()
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"{IMAGE} is not built: run the test command, or `manage.py engines image llamacpp`.")
    finally:
        client.close()
    return IMAGE


@pytest.fixture
def model_root(tmp_path, settings):
    """The one model directory deployments may read from."""
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    return root


@pytest.fixture
def node(db):
    """This machine, under the name the agent will use; its heartbeats keep the figures fresh."""
    from scheduler.services import register_node
    from serving.node.discovery import local_node_report

    return register_node(dataclasses.replace(local_node_report(), name=NODE))


@pytest.fixture
def agent(tmp_path, model_root, node, live_server):
    """A real agent on the node; whatever a test left running is stopped the way a person would."""
    from serving.deployments import service
    from serving.models import Deployment, Replica
    from tenancy.audit import Actor

    running = Agent(tmp_path, model_root, live_server.url)
    yield running
    try:
        for deployment in Deployment.objects.exclude(state__in=("stopped", "failed")):
            service.stop(Actor(system="tests"), deployment)
        wait_until(lambda: not Replica.objects.exclude(state__in=("stopped", "failed")).exists(), 60,
                   what="every replica stopped")
    finally:
        running.stop()
