"""The Docker daemon the test command starts follows the network rule: no bridge network."""

import docker
import pytest

pytestmark = pytest.mark.docker


def test_docker_daemon_answers_and_has_no_bridge_network():
    client = docker.from_env()
    try:
        assert client.ping() is True
        names = {network.name for network in client.networks.list()}
        assert "bridge" not in names  # the default bridge (172.17.x) would be a private range
        assert "host" in names
    finally:
        client.close()
