"""What a node says of its accelerators, telemetry and model directories: plain, frozen data.

The agent (Serving) builds these from the NVML adapter (``scheduler.nvml``) and its own scans;
``scheduler.services.register_node`` turns them into inventory rows. ``None`` means "not
measured", never zero.
"""

from __future__ import annotations

import dataclasses


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
