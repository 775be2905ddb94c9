"""What this machine is: the facts a node reports about itself when it registers, and the memory
its GPUs hold now (read around each load to measure what the engine took).

GPUs are read through the scheduler's NVML adapter only, with the NVML ``agent_nvml`` gives (tests
replace it with recorded outputs of real machines).
"""

from __future__ import annotations

import os
import socket

from django.conf import settings

import berth
from scheduler.nvml import DeviceMemory, discover_gpus, load_pynvml, read_device_memory
from scheduler.reports import HeldWeightReport, ModelDirectoryReport
from scheduler.reports import NodeReport
from serving.engines.installed import local_engines

AGENT_VERSION = getattr(berth, "__version__", "0.1.0")


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """MemTotal/MemAvailable in bytes; a field the kernel did not give is absent, not zero."""
    values = {}
    try:
        with open(path) as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
                    values[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return values


WEIGHT_SUFFIXES = {".gguf": "gguf", ".safetensors": "safetensors"}
MAX_REPORTED_WEIGHTS = 5000  # per directory: a heartbeat stays small whatever lies on the disk


def model_directories() -> tuple:
    """The weights this node holds under its model directories (BERTH_MODEL_ROOTS), by relative path."""
    reports = []
    for root in settings.SCHEDULER_MODEL_ROOTS:
        weights = []
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                if path.suffix in WEIGHT_SUFFIXES and path.is_file():
                    weights.append(HeldWeightReport(path=str(path.relative_to(root)), size_bytes=path.stat().st_size,
                                                    format=WEIGHT_SUFFIXES[path.suffix]))
                    if len(weights) >= MAX_REPORTED_WEIGHTS:
                        break
        reports.append(ModelDirectoryReport(path=str(root), weights=tuple(weights)))
    return tuple(reports)


def agent_nvml():
    """The NVML this agent reads GPUs through: ``pynvml``, or ``None`` where it is not installed."""
    return load_pynvml()


def device_memory(uuids) -> dict[str, DeviceMemory]:
    """What each of ``uuids`` (this machine's GPUs or MIG instances) holds now, by device and by
    process; empty where NVML cannot be read."""
    return read_device_memory(list(uuids), agent_nvml()) if uuids else {}


def local_node_report() -> NodeReport:
    memory = meminfo()
    return NodeReport(
        name=settings.NODE_NAME or socket.gethostname(),
        address=settings.NODE_ADDRESS,
        cpu_count=os.cpu_count(),
        memory_total_bytes=memory.get("MemTotal"),
        memory_available_bytes=memory.get("MemAvailable"),
        agent_version=AGENT_VERSION,
        engines=tuple(local_engines()),
        cpu_load_1m=os.getloadavg()[0],
        gpus=discover_gpus(agent_nvml()),
        model_directories=model_directories(),
    )
