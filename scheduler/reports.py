"""What a node says of its accelerators, telemetry and model directories: plain, frozen data.

The agent (Serving) builds these from the NVML adapter (``scheduler.nvml``) and its own scans;
``scheduler.services.register_node`` turns them into inventory rows. ``None`` means "not
measured", never zero.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


@dataclasses.dataclass(frozen=True)
class MigInstanceReport:
    """One carved MIG instance (a GPU instance with its compute instance)."""

    uuid: str
    profile: str  # e.g. "3g.40gb"
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclasses.dataclass(frozen=True)
class GpuReport:
    """One physical card and what was measured of it."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    pci_bus_id: str = ""
    mig_enabled: bool = False
    mig_instances: tuple[MigInstanceReport, ...] = ()
    healthy: bool | None = None  # None: health not read
    health_reason: str = ""
    utilisation_percent: float | None = None
    temperature_c: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    throttle_reasons: tuple[str, ...] | None = None  # () = read and none active; None = not read


@dataclasses.dataclass(frozen=True)
class GpuDiscovery:
    """The result of one discovery pass: the cards, how they were read, and why none if none."""

    gpus: tuple[GpuReport, ...] = ()
    source: str = ""  # "nvml", "nvidia-smi" or "" when nothing could be read
    note: str = ""  # e.g. "NVML library not found: no GPUs"
    driver_version: str = ""
    cuda_version: str = ""


@dataclasses.dataclass(frozen=True)
class HeldWeightReport:
    path: str  # relative to its directory
    size_bytes: int | None = None
    format: str = ""  # "gguf", "safetensors", ...


@dataclasses.dataclass(frozen=True)
class ModelDirectoryReport:
    path: str
    weights: tuple[HeldWeightReport, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineReport:
    kind: str
    version: str
    source: str = ""
    path: str = ""
    state: str = "ready"  # NodeEngine.State.READY: the tables stay out of the wire shapes
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """What a node says of itself. ``None`` means "not measured", never zero."""

    name: str
    address: str
    cpu_count: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    agent_version: str = ""
    engines: tuple[EngineReport, ...] = ()
    cpu_load_1m: float | None = None
    unified_memory: bool = False
    # None: this report did not look (the rows stay as they are); a discovery with no GPUs: none.
    gpus: GpuDiscovery | None = None
    model_directories: tuple[ModelDirectoryReport, ...] | None = None


def from_wire(cls, data: Any, where: str = ""):
    """A report (``cls``, one of these frozen dataclasses or ``scheduler.services.NodeReport``) from
    its JSON form, ``dataclasses.asdict``'s: nested reports and tuples of them included. A field of
    the wrong type, or one the report does not have, raises ``ValueError`` naming it."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object")
    hints = typing.get_type_hints(cls)
    names = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where} has no field {unknown[0]!r}")
    return cls(**{name: _value(hints[name], value, f"{where}.{name}") for name, value in data.items()})


def _value(hint: Any, value: Any, where: str):
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [arg for arg in args if arg is not type(None)]
        args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_wire(hint, value, where)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list")
        return tuple(_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"{where} must be {hint.__name__}")
    return value
