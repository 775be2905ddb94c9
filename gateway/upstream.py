"""Choosing a replica and keeping failing ones out of routing for a while.

Per process: each process counts its own outstanding requests per replica (least outstanding first)
and its own connection failures (a replica that fails ``failures`` times in a row is skipped for
``cooldown`` seconds, unless every replica of the model is, when they are all tried anyway).
"""

from __future__ import annotations

import itertools
import time

from serving.control.routing import Endpoint


class Balancer:
    def __init__(self, failures: int, cooldown: float):
        self.failures = failures
        self.cooldown = cooldown
        self.outstanding: dict[str, int] = {}
        self._fails: dict[str, int] = {}
        self._open_until: dict[str, float] = {}
        self._turn = itertools.count()

    def available(self, endpoints: tuple[Endpoint, ...], exclude: str | None = None) -> list[Endpoint]:
        now = time.monotonic()
        usable = [e for e in endpoints if e.replica_id != exclude and self._open_until.get(e.replica_id, 0) <= now]
        if not usable:
            usable = [e for e in endpoints if e.replica_id != exclude]
        return usable

    def pick(self, endpoints: tuple[Endpoint, ...], exclude: str | None = None) -> Endpoint | None:
        usable = self.available(endpoints, exclude)
        if not usable:
            return None
        if len(usable) == 1:
            return usable[0]
        start = next(self._turn) % len(usable)  # rotate ties so equal replicas share the load
        rotated = usable[start:] + usable[:start]
        return min(rotated, key=lambda e: self.outstanding.get(e.replica_id, 0))

    def begin(self, endpoint: Endpoint) -> None:
        self.outstanding[endpoint.replica_id] = self.outstanding.get(endpoint.replica_id, 0) + 1

    def end(self, endpoint: Endpoint) -> None:
        left = self.outstanding.get(endpoint.replica_id, 1) - 1
        if left > 0:
            self.outstanding[endpoint.replica_id] = left
        else:
            self.outstanding.pop(endpoint.replica_id, None)

    def failed(self, endpoint: Endpoint) -> None:
        count = self._fails.get(endpoint.replica_id, 0) + 1
        self._fails[endpoint.replica_id] = count
        if count >= self.failures:
            self._open_until[endpoint.replica_id] = time.monotonic() + self.cooldown

    def succeeded(self, endpoint: Endpoint) -> None:
        if endpoint.replica_id in self._fails:
            self._fails.pop(endpoint.replica_id, None)
            self._open_until.pop(endpoint.replica_id, None)

    def is_open(self, replica_id: str) -> bool:
        return self._open_until.get(replica_id, 0) > time.monotonic()
