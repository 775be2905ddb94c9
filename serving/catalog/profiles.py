"""A catalog profile in its engine's terms.

A profile states its settings once, in the catalog's words — ``context`` (tokens: llama.cpp's
``-c`` for all its slots, vLLM's ``--max-model-len`` per sequence) and ``parallel`` (requests at
once: llama.cpp's slots, vLLM's ``--max-num-seqs``). This module turns them into the engine's
configuration, which is what a replica runs with, what its memory is estimated from (each engine
maps its keys to the estimator's: ``Engine.estimation_config``) and what load scaling counts as one
replica's capacity — one translation, so the three never disagree. The names each engine uses are
the engine's own (``serving.engines``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from django.conf import settings

from serving.engines.registry import ENGINES, engine_for, estimation_config

GIB = 2**30
DEFAULT_CONTEXT = 4096  # where neither the configuration, the engine nor the model says
MIN_DEGRADED_CONTEXT = 256  # a degraded relaunch halves the context, never below this; the minimal footprint's
# Engines that can run a model on the CPU alone (the minimal footprint moves there); vLLM needs a GPU.
CPU_ENGINES = frozenset({"llamacpp"})


# --- where a profile may run: the placement constraints it hands the policy ---------------------------

# ``accelerator_class`` (one class or a list: a replica runs on any of them; a class names its family
# too, "h100" takes "h100-80g"), ``node_selector`` ({label: value} every node must carry), ``min_disk``
# (bytes, or a size such as "40 GiB": free disk a node needs to fetch the weights, unless it holds
# them) and ``mig`` (whether MIG instances are acceptable; default true).
PLACEMENT_KEYS = ("accelerator_class", "node_selector", "min_disk", "mig")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def size_bytes(value: Any) -> int:
    """Bytes from a whole number of bytes or a size text ("40 GiB", "500MB", "1.5 TB"); ValueError
    otherwise. GB is 10^9 bytes and GiB 2^30, as disks and the console write them."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(value)
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(value)
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def accelerator_classes(profile: dict) -> tuple[str, ...]:
    wanted = profile.get("accelerator_class") or ()
    return (wanted,) if isinstance(wanted, str) else tuple(wanted)


def placement_constraints(profile: dict) -> dict[str, Any]:
    """The profile's constraints as the policy's ``Profile`` fields (a profile that passed validation)."""
    return {"accelerator_class": accelerator_classes(profile),
            "node_selector": dict(profile.get("node_selector") or {}),
            "min_disk_bytes": size_bytes(profile["min_disk"]) if profile.get("min_disk") is not None else 0,
            "allow_mig": profile.get("mig", True) is not False}


def weights_key(entry) -> str:
    """What a node reports holding when it holds the entry's weights: the first profile's file (a
    GGUF) or folder (safetensors) relative to the model root it lies under, as nodes report what
    their model roots hold (a folder counts as held where the node holds files in it, see
    ``scheduler.snapshot.node_info``). Empty when the file lies under no root."""
    file = first(entry).get("file")
    if not file:
        return ""
    path = Path(file)
    for root in settings.SCHEDULER_MODEL_ROOTS:
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return ""


def constrained(model, entry):
    """The policy's ``DesiredModel`` for ``entry`` with each profile's placement constraints (matched
    by name, the minimal footprint's too) and the weights key, so those filters and the
    weights-locality preference act."""
    by_name = {p.get("name") or f"profile-{i}": p for i, p in enumerate(entry.profiles or [])}

    def apply(profile):
        written = by_name.get(profile.name)
        return dataclasses.replace(profile, **placement_constraints(written)) if written is not None else profile

    return dataclasses.replace(model, profiles=tuple(apply(p) for p in model.profiles),
                               minimal=tuple(apply(p) for p in model.minimal), weights_key=weights_key(entry))


def named(entry, name: str | None) -> dict | None:
    """The entry's profile called ``name`` (for None, its first), or None when it has no such profile."""
    return next((p for p in entry.profiles or [] if name in (None, p.get("name"))), None)


def first(entry) -> dict:
    """The profile a model goes by where one is needed (its card's servability and estimate, load
    scaling's capacity): the first; empty when it has none."""
    return next(iter(entry.profiles or []), None) or {}


def engine(profile: dict) -> str:
    return profile.get("engine") or "llamacpp"


def engine_config(profile: dict, kind: str | None = None) -> dict[str, Any]:
    """The engine configuration a profile asks for (``kind`` overrides the profile's engine)."""
    names = engine_for(kind or engine(profile)).catalog_keys
    return {names[key]: profile[key] for key in names if profile.get(key)}


def running_context(kind: str, config: dict | None) -> int | None:
    """The context (tokens) an engine runs with ``config``: the configured one, else what Berth
    starts it with — llama.cpp 4096 tokens, vLLM the model's own length (None: only the model knows)."""
    known = engine_for(kind if kind in ENGINES else "llamacpp")
    value = (config or {}).get(known.catalog_keys["context"])
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return known.default_context


def running_slots(kind: str, config: dict | None) -> int:
    """How many requests an engine run with ``config`` takes at once: the configured slots, else its
    default (llama.cpp one, vLLM 256)."""
    known = engine_for(kind if kind in ENGINES else "llamacpp")
    value = (config or {}).get(known.catalog_keys["parallel"])
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return known.default_slots


def estimate_config(profile: dict, kind: str | None = None) -> dict[str, Any]:
    """The same settings in the memory estimator's names, for one accelerator of the profile's
    (``estimation_config``: llama.cpp offloads every layer to its GPUs, vLLM shards over them). An
    unset context is what the engine runs: Berth starts llama.cpp at 4096 tokens, vLLM at the
    model's own length (the estimator's default for both would be the model's)."""
    kind = kind or engine(profile)
    config = engine_config(profile, kind)
    context = running_context(kind, config)
    if context is not None:
        config[engine_for(kind).catalog_keys["context"]] = context
    return estimation_config(kind, config, gpus(profile, kind))


def gpus(profile: dict, kind: str | None = None) -> int:
    """How many accelerators one replica of the profile takes (vLLM: at least one)."""
    kind = kind or engine(profile)
    return int(profile.get("gpus", 1 if kind == "vllm" else 0) or 0)


def slots(profile: dict) -> int:
    """How many requests one replica takes at once, as configured."""
    return int(profile.get("parallel") or engine_for(engine(profile)).default_slots)


def degraded(kind: str, config: dict[str, Any], shape, *, on_gpu: bool, shards: int = 1) -> dict[str, Any]:
    """The recovery ladder's degraded relaunch (after running out of memory, or hanging twice):
    half the context — the KV cache shrinks with it — and, on a GPU, a quarter of the weights off
    it: llama.cpp keeps three quarters of its layers on the GPU, vLLM offloads a quarter of each
    GPU's weights to host memory (``--cpu-offload-gb``). ``shape`` is the model's, as read."""
    config = dict(config)
    key = engine_for(kind).catalog_keys["context"]
    context = running_context(kind, config) or shape.context_length or DEFAULT_CONTEXT
    config[key] = max(MIN_DEGRADED_CONTEXT, context // 2)
    if on_gpu and kind == "llamacpp":
        config["gpu_layers"] = shape.layers * 3 // 4
    elif on_gpu and kind == "vllm":
        config["cpu_offload_gb"] = math.ceil(shape.weights_bytes / max(1, shards) / 4 / GIB * 100) / 100
    return config


def runs_on_cpu(kind: str) -> bool:
    """Whether ``kind`` can run a model with no accelerator at all."""
    return kind in CPU_ENGINES


def minimal(kind: str, config: dict[str, Any], shape, *, on_gpu: bool, shards: int = 1) -> dict[str, Any]:
    """The recovery ladder's last rung, tried once before a model with no fallback is parked: the
    smallest context (``MIN_DEGRADED_CONTEXT``), one slot, and no GPU offload — llama.cpp runs on
    the CPU (``on_gpu`` False: the caller deploys it with no accelerator), every layer in host
    memory; vLLM, which needs a GPU, stays on its own with the degraded relaunch's weights offload
    (``degraded``), the least GPU memory it can run in. No draft model (the caller adds none)."""
    config = degraded(kind, config, shape, on_gpu=on_gpu, shards=shards)
    names = engine_for(kind).catalog_keys
    config[names["context"]] = MIN_DEGRADED_CONTEXT
    config[names["parallel"]] = 1
    config.pop("draft_model", None)
    if kind == "llamacpp":
        config["gpu_layers"] = 0
    return config
