"""Engine ports: each holding replica owns one port of its node's range."""

from __future__ import annotations

import socket

from django.conf import settings

from serving.errors import NoFreePort
from serving.models import HOLDING, Replica


def allocate(node) -> int:
    """The lowest port of the range that no holding replica of ``node`` owns and nothing on this
    machine listens on (for the local node). The unique constraint on (node, port) among holding
    replicas settles a race: the loser's transaction fails and is retried by its caller."""
    low, high = settings.SERVING_PORT_RANGE
    taken = set(Replica.objects.filter(node=node, state__in=HOLDING).values_list("port", flat=True))
    for port in range(low, high + 1):
        if port in taken:
            continue
        if node.address in ("127.0.0.1", "localhost", "::1") and _listening(port):
            continue
        return port
    raise NoFreePort(f"No free engine port on {node.name} in {low}-{high}.")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.05)
        return sock.connect_ex(("127.0.0.1", port)) == 0
