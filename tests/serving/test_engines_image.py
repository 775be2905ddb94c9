"""The local llama.cpp image: built by the test command (or `manage.py engines image llamacpp`) from a
debootstrap base and the cached llama-server, never pulled."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from serving.engines import build_llamacpp
from serving.engines.llamacpp_image import IMAGE

pytestmark = pytest.mark.docker


def test_image_command_reuses_the_present_image(llamacpp_image):
    out = io.StringIO()

    call_command("engines", "image", "llamacpp", stdout=out)

    assert f"{IMAGE} is present" in out.getvalue()
    assert f"llamacpp image: {IMAGE}" in out.getvalue()


def test_image_runs_the_same_llama_server_as_the_host(llamacpp_image, docker_client, llama_server_binary):
    output = docker_client.containers.run(llamacpp_image, entrypoint=["llama-server"], command=["--version"],
                                          network_mode="host", remove=True, stdout=True, stderr=True)

    assert build_llamacpp.read_version(llama_server_binary) in output.decode()
    assert IMAGE == f"berth/llama-server:{build_llamacpp.SDIST_VERSION}"
