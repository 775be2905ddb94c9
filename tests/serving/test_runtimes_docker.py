"""The Docker runtime with the locally built llama.cpp image, on the daemon the test command started
(no bridge network: every container uses the host network and binds 127.0.0.1)."""

from __future__ import annotations

import docker.errors
import httpx
import pytest

from serving.engines.base import EngineCommand
from serving.engines.llamacpp import LlamaCpp
from serving.errors import ImageMissing
from serving.runtimes.docker import OOM_EVIDENCE, DockerRuntime
from tests.assets.waiting import wait_until

pytestmark = pytest.mark.docker

MiB = 2**20


@pytest.fixture
def engine(llama_server_binary, llamacpp_image):
    return LlamaCpp(binary=llama_server_binary, image=llamacpp_image)


def base_url(spec) -> str:
    return f"http://{spec.host}:{spec.port}"


def ended(runtime, handle):
    status = runtime.status(handle)
    return status if not status.running else None


def healthy(runtime, handle, spec) -> bool:
    status = runtime.status(handle)
    if not status.running:
        raise AssertionError(f"the container ended ({status.exit.describe()}): {runtime.logs(handle, 20)}")
    try:
        return httpx.get(base_url(spec) + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_container_serves_a_real_completion_on_the_host_network_and_is_removed_on_stop(
        docker_runtime, docker_client, engine, launch_spec, gguf_model):
    spec = launch_spec(gguf_model(), cores=1, memory_limit_bytes=512 * MiB,
                       labels={"berth.deployment": "dep-123"})

    handle = docker_runtime.start(spec, engine.command(spec))
    wait_until(lambda: healthy(docker_runtime, handle, spec), 120, what="llama-server /health in the container")

    probe = engine.probe(spec, "completion")
    answer = httpx.post(base_url(spec) + probe.path, json=probe.body, timeout=30,
                        headers={"Authorization": f"Bearer {spec.api_key}"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 1

    container = docker_client.containers.get(handle.container_id)
    assert container.labels["berth.managed"] == "true"
    assert container.labels["berth.replica"] == spec.replica_id
    assert container.labels["berth.deployment"] == "dep-123"
    host_config = container.attrs["HostConfig"]
    assert host_config["NetworkMode"] == "host"
    assert host_config["Memory"] == 512 * MiB
    assert host_config["NanoCpus"] == 1_000_000_000
    assert not host_config.get("DeviceRequests")  # no GPU placement, no GPU request
    mount = container.attrs["Mounts"][0]
    assert mount["Source"] == str(gguf_model().parent) and mount["RW"] is False
    assert spec.api_key not in " ".join(container.attrs["Args"])
    assert f"LLAMA_API_KEY={spec.api_key}" in container.attrs["Config"]["Env"]

    status = docker_runtime.status(handle)
    assert status.running and status.peak_memory_bytes and status.peak_memory_bytes > 1_000_000
    assert handle in DockerRuntime(client=docker_client).managed()  # found again by label after a restart

    exit = docker_runtime.stop(handle, grace_seconds=10)

    assert exit is not None and not exit.out_of_memory
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(handle.container_id)
    assert handle not in docker_runtime.managed()


def test_a_container_over_its_memory_limit_is_reported_out_of_memory_with_evidence(
        docker_runtime, engine, launch_spec, gguf_model):
    # A wide model with a 32k context wants ~256 MiB of KV cache; the limit is 64 MiB.
    model = gguf_model("wide.gguf", embedding=512, heads=8, kv_heads=8, layers=4, feed_forward=1024, context=4096)
    spec = launch_spec(model, memory_limit_bytes=64 * MiB, config={"context": 32768})

    handle = docker_runtime.start(spec, engine.command(spec))
    status = wait_until(lambda: ended(docker_runtime, handle), 120, what="the container to be killed")

    assert status.exit.out_of_memory
    assert status.exit.oom_evidence == OOM_EVIDENCE
    assert status.exit.describe() == "out of memory (Docker OOMKilled)"


def test_a_killed_container_is_a_sigkill_not_out_of_memory(docker_runtime, docker_client, engine, launch_spec,
                                                           gguf_model):
    spec = launch_spec(gguf_model(), memory_limit_bytes=512 * MiB)
    handle = docker_runtime.start(spec, engine.command(spec))
    wait_until(lambda: healthy(docker_runtime, handle, spec), 120, what="llama-server /health in the container")

    docker_client.containers.get(handle.container_id).kill()  # exit 137, no OOMKilled
    status = wait_until(lambda: ended(docker_runtime, handle), 30, what="the container to die")

    assert status.exit.code == 137 and status.exit.signal == 9
    assert not status.exit.out_of_memory
    assert status.exit.describe() == "killed by SIGKILL"


def test_a_corrupt_model_ends_the_container_and_its_log_says_why(docker_runtime, engine, launch_spec, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 4096)
    spec = launch_spec(corrupt, memory_limit_bytes=256 * MiB)

    handle = docker_runtime.start(spec, engine.command(spec))
    status = wait_until(lambda: ended(docker_runtime, handle), 60, what="the container to exit")

    assert status.exit.code == 1 and not status.exit.out_of_memory
    assert "failed to load model" in docker_runtime.logs(handle, lines=200)


def test_a_missing_image_is_refused_when_pulling_is_not_allowed(docker_runtime, launch_spec, tmp_path):
    spec = launch_spec(tmp_path / "m.gguf")
    command = EngineCommand(argv=("llama-server", "--version"), env={}, image="berth/llama-server:not-built")

    with pytest.raises(ImageMissing) as caught:
        docker_runtime.start(spec, command)

    assert caught.value.code == "image_missing"
    assert caught.value.details["image"] == "berth/llama-server:not-built"
    assert "manage.py engines image llamacpp" in caught.value.message


def test_a_vanished_container_is_reported_as_such(docker_runtime, docker_client, engine, launch_spec, gguf_model):
    spec = launch_spec(gguf_model(), memory_limit_bytes=256 * MiB)
    handle = docker_runtime.start(spec, engine.command(spec))
    docker_client.containers.get(handle.container_id).remove(force=True)  # removed behind Berth's back

    status = docker_runtime.status(handle)

    assert not status.running and status.exit.describe() == "vanished"
    assert docker_runtime.stop(handle) is None
