"""Which runtime implements a kind: ``"process"`` or ``"docker"``."""

from __future__ import annotations

from serving.errors import InvalidInput
from serving.runtimes.base import Runtime

RUNTIMES = ("process", "docker")


def runtime_for(kind: str) -> Runtime:
    # Each runtime is imported when asked for: the Docker one loads the Docker SDK, which a node that
    # runs engines as processes does without.
    if kind == "process":
        from serving.runtimes.process import ProcessRuntime

        return ProcessRuntime()
    if kind == "docker":
        from serving.runtimes.docker import DockerRuntime

        return DockerRuntime()
    raise InvalidInput(f"No runtime {kind!r}; known: {', '.join(RUNTIMES)}.", code="unknown_runtime",
                       details={"known": list(RUNTIMES)})
