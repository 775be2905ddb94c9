"""The agent's runtimes: one object per kind for the agent's life (a process runtime remembers the
engines it started: their exit statuses reach only their parent)."""

from __future__ import annotations

import logging

from serving.runtimes.base import Handle
from serving.runtimes.registry import runtime_for as make_runtime

log = logging.getLogger(__name__)
KINDS = ("process", "docker")
_runtimes: dict = {}


def runtime_for(kind: str):
    if kind not in _runtimes:
        _runtimes[kind] = make_runtime(kind)
    return _runtimes[kind]


def managed() -> list[Handle]:
    """Every managed engine running on this node, of either runtime."""
    handles = []
    for kind in KINDS:
        try:
            handles += runtime_for(kind).managed()
        except Exception as error:  # a runtime this node does not have (no Docker daemon): nothing of it runs
            log.debug("no %s engines here: %s", kind, error)
    return handles
