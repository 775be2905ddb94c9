"""What every engine provides: a validated configuration, a command line, and how to probe it.

An engine (llama.cpp's llama-server, vLLM) knows its flags and HTTP contract; a runtime
(``serving.runtimes``) knows how to run a command (a process, a container). A deployment joins one
of each through a ``LaunchSpec``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from serving.engines.options import Option


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one replica, decided before anything starts."""

    replica_id: str
    engine: str  # "llamacpp" | "vllm"
    model_path: str  # a file (GGUF) or a directory (safetensors) under an allowed root
    served_name: str  # the name the engine answers to (the gateway rewrites requests to it)
    host: str  # loopback or the node's address
    port: int
    api_key: str  # the per-replica key: only the gateway holds it; passed through the environment
    config: dict[str, Any]  # the engine's validated configuration (see Engine.validate_config)
    cores: int | None = None  # reserved CPU cores (threads; container CPU limit)
    memory_limit_bytes: int | None = None  # container memory limit from the reservation
    gpu_uuids: tuple[str, ...] = ()  # placement: GPU or MIG instance UUIDs
    gpu_memory_total_bytes: int | None = None  # of the card, for vLLM's utilisation fraction
    reservation_bytes: int | None = None  # what the scheduler reserved on the device
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    log_path: Path | None = None


@dataclasses.dataclass(frozen=True)
class EngineCommand:
    argv: tuple[str, ...]
    env: dict[str, str]  # secrets go here, never in argv (argv is visible to every local user)
    image: str | None = None  # for the Docker runtime: the image that carries the engine


@dataclasses.dataclass(frozen=True)
class ProbeRequest:
    """The one real request that proves a replica ready (health alone is not enough)."""

    path: str
    body: dict[str, Any]


def translated(config: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The keys of ``config`` that ``names`` maps (engine key → estimator key), under their new names."""
    return {names[key]: value for key, value in config.items() if key in names and value is not None}


class Engine(Protocol):
    kind: str
    label: str  # as people write it: "llama.cpp", "vLLM"
    options: dict[str, Option]  # its configuration keys (``serving.engines.options``)
    # The catalog's profile settings ("context", "parallel") → this engine's configuration keys.
    catalog_keys: dict[str, str]
    default_slots: int  # requests one replica takes at once when the configuration does not say
    default_context: int | None  # the context Berth starts it with unset (None: the model's own)

    def estimation_config(self, config: dict[str, Any], gpus: int = 0) -> dict[str, Any]:
        """``config`` in the memory estimator's names, with what the engine does by default on
        ``gpus`` placed accelerators."""

    def validate_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The configuration with defaults applied; raises InvalidEngineConfig listing every problem."""

    def command(self, spec: LaunchSpec) -> EngineCommand: ...

    def health_path(self) -> str: ...

    def probe(self, spec: LaunchSpec, task: str) -> ProbeRequest: ...
