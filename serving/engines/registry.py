"""Which engine implements a kind: the one place that maps ``"llamacpp"``/``"vllm"`` to code."""

from __future__ import annotations

from typing import Any

from serving.engines.base import Engine
from serving.engines.llamacpp import LlamaCpp
from serving.engines.vllm import VLLM
from serving.errors import UnknownEngine

ENGINES: dict[str, type] = {"llamacpp": LlamaCpp, "vllm": VLLM}


def estimation_config(kind: str, config: dict[str, Any], gpus: int = 0) -> dict[str, Any]:
    """An engine configuration in the memory estimator's names, with the engine's defaults on ``gpus``
    placed accelerators (``Engine.estimation_config``)."""
    return engine_for(kind).estimation_config(config, gpus)


def engine_for(kind: str) -> Engine:
    try:
        return ENGINES[kind]()
    except KeyError:
        raise UnknownEngine(f"No engine {kind!r}; known: {', '.join(ENGINES)}.",
                            details={"known": list(ENGINES)}) from None
