"""The one way Berth reads NVIDIA GPUs: NVML through ``pynvml``, else ``nvidia-smi -q -x``.

Everything GPU-shaped enters the scheduler through ``discover_gpus`` (the inventory) and
``read_device_memory`` (what a load took, read around it by the node agent). Tests hand them recorded
outputs of real machines (a module shaped like ``pynvml``, the text ``nvidia-smi`` printed), so
nothing here may reach for NVML on its own. ``NVMLError_LibraryNotFound`` means the machine has no
NVIDIA driver, hence no GPUs; other NVML failures fall back to ``nvidia-smi``. A figure that could
not be read is ``None`` (unknown is not zero), and one card failing to answer does not hide the
others: it is reported unhealthy with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from typing import Any, Callable, Collection, Mapping, Sequence

from scheduler.reports import GpuDiscovery, GpuReport, MigInstanceReport

log = logging.getLogger(__name__)

MIB = 1024 * 1024

# NVML's clock-event ("throttle") bits, by the names the console shows.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the card is held back, as opposed to merely idle.
_SMI_THROTTLE_TAGS = {
    "gpu_idle": "gpu_idle",
    "applications_clocks_setting": "applications_clocks_setting",
    "sw_power_cap": "sw_power_cap",
    "hw_slowdown": "hw_slowdown",
    "sync_boost": "sync_boost",
    "sw_thermal_slowdown": "sw_thermal_slowdown",
    "hw_thermal_slowdown": "hw_thermal_slowdown",
    "hw_power_brake_slowdown": "hw_power_brake_slowdown",
    "display_clock_setting": "display_clock_setting",
}

SmiRunner = Callable[[list[str]], str]


def discover_gpus(nvml: Any = None, run_smi: SmiRunner | None = None) -> GpuDiscovery:
    """Read this machine's GPUs. ``nvml`` is the ``pynvml`` module (or a recording of one);
    ``run_smi`` runs ``nvidia-smi`` with the given arguments and returns its output."""
    if nvml is None:
        nvml = load_pynvml()
    if run_smi is None:
        run_smi = _run_nvidia_smi
    if nvml is not None:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound:
            return GpuDiscovery(note="NVML library not found: no GPUs on this machine.")
        except nvml.NVMLError as error:
            log.warning("NVML did not initialise (%s); trying nvidia-smi", error)
            return _from_smi(run_smi, f"NVML did not initialise ({error}); read through nvidia-smi.")
        try:
            return _from_nvml(nvml)
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass
    return _from_smi(run_smi, "pynvml is not installed; read through nvidia-smi.")


def load_pynvml() -> Any:
    """The ``pynvml`` module, or ``None`` where it is not installed."""
    try:
        import pynvml  # noqa: PLC0415 - optional at import time on CPU-only machines
    except ImportError:
        return None
    return pynvml


# --- NVML ------------------------------------------------------------------------------------

def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _from_nvml(nvml: Any) -> GpuDiscovery:
    def read(fn: str, *args: Any) -> Any:
        """One NVML call; ``None`` when the card does not support it. A lost GPU propagates."""
        try:
            return getattr(nvml, fn)(*args)
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError:
            return None

    driver = read("nvmlSystemGetDriverVersion")
    cuda = read("nvmlSystemGetCudaDriverVersion")
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else ""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(read("nvmlDeviceGetName", handle) or "")
        uuid = _text(read("nvmlDeviceGetUUID", handle) or "")
        try:
            gpus.append(_nvml_gpu(nvml, read, handle, index, name, uuid))
        except nvml.NVMLError_GpuIsLost:
            gpus.append(GpuReport(index=index, uuid=uuid or f"lost-{index}", name=name, healthy=False,
                                  health_reason="The GPU is lost (fell off the bus); it needs a reset or a reboot."))
    return GpuDiscovery(gpus=tuple(gpus), source="nvml", driver_version=_text(driver or ""), cuda_version=cuda_text)


def _nvml_gpu(nvml, read, handle, index: int, name: str, uuid: str) -> GpuReport:
    memory = read("nvmlDeviceGetMemoryInfo", handle)
    pci = read("nvmlDeviceGetPciInfo", handle)
    utilisation = read("nvmlDeviceGetUtilizationRates", handle)
    temperature = read("nvmlDeviceGetTemperature", handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
    power = read("nvmlDeviceGetPowerUsage", handle)
    limit = read("nvmlDeviceGetEnforcedPowerLimit", handle)
    reasons = read("nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None:
        reasons = read("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    mig_mode = read("nvmlDeviceGetMigMode", handle)
    mig_enabled = bool(mig_mode and mig_mode[0] == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))
    instances = _nvml_mig_instances(nvml, read, handle) if mig_enabled else ()
    healthy, reason = _nvml_health(nvml, read, handle)
    return GpuReport(
        index=index, uuid=uuid, name=name,
        memory_total_bytes=getattr(memory, "total", None), memory_used_bytes=getattr(memory, "used", None),
        pci_bus_id=_text(getattr(pci, "busId", "") or ""),
        mig_enabled=mig_enabled, mig_instances=instances, healthy=healthy, health_reason=reason,
        utilisation_percent=None if utilisation is None else float(utilisation.gpu),
        temperature_c=None if temperature is None else float(temperature),
        power_watts=None if power is None else power / 1000,
        power_limit_watts=None if limit is None else limit / 1000,
        throttle_reasons=None if reasons is None else throttle_names(reasons),
    )


def _nvml_mig_instances(nvml, read, handle) -> tuple[MigInstanceReport, ...]:
    instances = []
    for slot in range(read("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError_GpuIsLost:
            raise
        except nvml.NVMLError:
            continue  # an empty slot: nothing carved there
        memory = read("nvmlDeviceGetMemoryInfo", mig)
        instances.append(MigInstanceReport(
            uuid=_text(read("nvmlDeviceGetUUID", mig) or ""),
            profile=mig_profile_from_name(_text(read("nvmlDeviceGetName", mig) or "")),
            memory_total_bytes=getattr(memory, "total", None), memory_used_bytes=getattr(memory, "used", None),
            gpu_instance_id=read("nvmlDeviceGetGpuInstanceId", mig),
            compute_instance_id=read("nvmlDeviceGetComputeInstanceId", mig),
        ))
    return tuple(instances)


def _nvml_health(nvml, read, handle) -> tuple[bool, str]:
    remapped = read("nvmlDeviceGetRemappedRows", handle)
    if remapped is not None:
        _corrected, _uncorrected, pending, failure = remapped
        if failure:
            return False, "Row remapping failed: the card's memory has failed rows it cannot replace."
        if pending:
            return False, "Row remapping is pending: the card needs a reset before it is used again."
    uncorrected = read("nvmlDeviceGetTotalEccErrors", handle,
                       getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), getattr(nvml, "NVML_VOLATILE_ECC", 0))
    if uncorrected:
        return False, f"{uncorrected} uncorrectable ECC error(s) since the last reset."
    return True, ""


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_BITS.items() if mask & bit)


_MIG_NAME = re.compile(r"MIG\s+(\d+g\.\d+gb(?:\+me)?)", re.IGNORECASE)


def mig_profile_from_name(name: str) -> str:
    """``NVIDIA A100-SXM4-80GB MIG 3g.40gb`` → ``3g.40gb``."""
    match = _MIG_NAME.search(name)
    return match.group(1).lower() if match else ""


# --- nvidia-smi ---------------------------------------------------------------------------------

def _run_nvidia_smi(args: list[str]) -> str:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        raise FileNotFoundError("nvidia-smi is not on PATH")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, check=True).stdout


def _from_smi(run_smi: SmiRunner, why: str) -> GpuDiscovery:
    try:
        xml_text = run_smi(["-q", "-x"])
    except (OSError, subprocess.SubprocessError) as error:
        return GpuDiscovery(note=f"{why} nvidia-smi failed too ({error}): no GPUs read.")
    try:
        listing = run_smi(["-L"])
    except (OSError, subprocess.SubprocessError):
        listing = ""  # MIG profile names and UUIDs then come from the XML alone (when it has them)
    return parse_smi(xml_text, listing, note=why)


_LIST_GPU = re.compile(r"^GPU\s+(\d+):.*\(UUID:\s*(GPU-[^)]+)\)")
_LIST_MIG = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*(MIG-[^)]+)\)")


def _parse_listing(listing: str) -> dict[str, list[tuple[str, str]]]:
    """``nvidia-smi -L``: GPU UUID → [(MIG profile, MIG UUID)] in device order."""
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in listing.splitlines():
        if match := _LIST_GPU.match(line):
            current = match.group(2)
            result[current] = []
        elif (match := _LIST_MIG.match(line)) and current:
            result[current].append((match.group(1).lower(), match.group(3)))
    return result


def _mib(text: str | None) -> int | None:
    match = re.match(r"\s*([\d.]+)\s*MiB", text or "")
    return int(float(match.group(1)) * MIB) if match else None


def _number(text: str | None, unit: str) -> float | None:
    match = re.match(rf"\s*([\d.]+)\s*{unit}", text or "")
    return float(match.group(1)) if match else None


def _find(element: ET.Element, *paths: str) -> str | None:
    for path in paths:
        found = element.find(path)
        if found is not None and found.text is not None:
            return found.text.strip()
    return None


def parse_smi(xml_text: str, listing: str = "", note: str = "") -> GpuDiscovery:
    root = ET.fromstring(xml_text)
    migs_by_uuid = _parse_listing(listing)
    gpus = []
    for index, gpu in enumerate(root.findall("gpu")):
        uuid = _find(gpu, "uuid") or ""
        minor = _find(gpu, "minor_number")
        index_value = int(minor) if minor and minor.isdigit() else index
        mig_enabled = (_find(gpu, "mig_mode/current_mig") or "").lower() == "enabled"
        instances = []
        if mig_enabled:
            listed = migs_by_uuid.get(uuid, [])
            for position, device in enumerate(gpu.findall("mig_devices/mig_device")):
                profile, mig_uuid = listed[position] if position < len(listed) else ("", "")
                instances.append(MigInstanceReport(
                    uuid=mig_uuid or (_find(device, "uuid") or ""),
                    profile=profile,
                    memory_total_bytes=_mib(_find(device, "fb_memory_usage/total")),
                    memory_used_bytes=_mib(_find(device, "fb_memory_usage/used")),
                    gpu_instance_id=_int(_find(device, "gpu_instance_id")),
                    compute_instance_id=_int(_find(device, "compute_instance_id")),
                ))
        reasons_element = gpu.find("clocks_event_reasons")
        if reasons_element is None:
            reasons_element = gpu.find("clocks_throttle_reasons")
        reasons = None
        if reasons_element is not None:
            reasons = tuple(
                _SMI_THROTTLE_TAGS[key] for child in reasons_element
                if (key := re.sub(r"^clocks_(event|throttle)_reason_", "", child.tag)) in _SMI_THROTTLE_TAGS
                and (child.text or "").strip() == "Active"
            )
        healthy, reason = _smi_health(gpu)
        gpus.append(GpuReport(
            index=index_value, uuid=uuid, name=_find(gpu, "product_name") or "",
            memory_total_bytes=_mib(_find(gpu, "fb_memory_usage/total")),
            memory_used_bytes=_mib(_find(gpu, "fb_memory_usage/used")),
            pci_bus_id=_find(gpu, "pci/pci_bus_id") or gpu.get("id", ""),
            mig_enabled=mig_enabled, mig_instances=tuple(instances), healthy=healthy, health_reason=reason,
            utilisation_percent=_number(_find(gpu, "utilization/gpu_util"), "%"),
            temperature_c=_number(_find(gpu, "temperature/gpu_temp"), "C"),
            power_watts=_number(_find(gpu, "gpu_power_readings/power_draw", "gpu_power_readings/average_power_draw",
                                      "power_readings/power_draw"), "W"),
            power_limit_watts=_number(_find(gpu, "gpu_power_readings/current_power_limit",
                                            "power_readings/enforced_power_limit", "power_readings/power_limit"), "W"),
            throttle_reasons=reasons,
        ))
    return GpuDiscovery(gpus=tuple(gpus), source="nvidia-smi", note=note,
                        driver_version=_find(root, "driver_version") or "", cuda_version=_find(root, "cuda_version") or "")


def _int(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None


def _smi_health(gpu: ET.Element) -> tuple[bool, str]:
    if (_find(gpu, "remapped_rows/remapped_row_failure") or "").lower() == "yes":
        return False, "Row remapping failed: the card's memory has failed rows it cannot replace."
    if (_find(gpu, "remapped_rows/remapped_row_pending") or "").lower() == "yes":
        return False, "Row remapping is pending: the card needs a reset before it is used again."
    uncorrected = sum(_int(_find(gpu, f"ecc_errors/volatile/{tag}")) or 0
                      for tag in ("dram_uncorrectable", "sram_uncorrectable", "double_bit/total"))
    if uncorrected:
        return False, f"{uncorrected} uncorrectable ECC error(s) since the last reset."
    if (_find(gpu, "fb_memory_usage/total") or "").lower().startswith(("unknown", "gpu requires reset")):
        return False, "The GPU does not answer (nvidia-smi reports Unknown Error)."
    return True, ""


# --- device memory around a load ----------------------------------------------------------------

# How a load's device memory was measured (``CalibrationRecord.Measurement``'s values).
PER_PROCESS = "process"
DEVICE_DELTA = "device_delta"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One GPU's (or MIG instance's) memory at one moment. ``processes``: what each compute process
    holds there, by PID, ``None`` for a process whose figure the driver withholds; ``None`` as a
    whole when the driver lists no processes at all (not supported, or the call failed)."""

    uuid: str
    used_bytes: int | None
    processes: Mapping[int, int | None] | None


def read_device_memory(uuids: Sequence[str], nvml: Any = None) -> dict[str, DeviceMemory]:
    """The memory of each of ``uuids`` (GPU or MIG UUIDs) now, through NVML. A device NVML cannot
    find is absent; a figure it cannot read is ``None``; without NVML (no library, no driver) the
    answer is empty: nothing is known, which is not the same as nothing used."""
    nvml = load_pynvml() if nvml is None else nvml
    if nvml is None or not uuids:
        return {}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        log.info("NVML did not initialise (%s): device memory not read", error)
        return {}
    try:
        found = {}
        for uuid in uuids:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            except nvml.NVMLError as error:
                log.info("NVML does not find %s (%s): its memory is not read", uuid, error)
                continue
            found[uuid] = DeviceMemory(uuid=uuid, used_bytes=_used_bytes(nvml, handle),
                                       processes=_process_bytes(nvml, handle))
        return found
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _used_bytes(nvml: Any, handle: Any) -> int | None:
    try:
        used = getattr(nvml.nvmlDeviceGetMemoryInfo(handle), "used", None)
    except nvml.NVMLError:
        return None
    return used if isinstance(used, int) else None


def _process_bytes(nvml: Any, handle: Any) -> dict[int, int | None] | None:
    try:
        listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        return None
    processes: dict[int, int | None] = {}
    for process in listed or ():
        used = getattr(process, "usedGpuMemory", None)  # pynvml gives None for NVML_VALUE_NOT_AVAILABLE
        processes[int(process.pid)] = used if isinstance(used, int) else None
    return processes


@dataclasses.dataclass(frozen=True)
class LoadMemory:
    """What an engine took on its GPUs once loaded, and how that was measured. ``bytes`` is the
    fullest device's (an estimate is what each GPU must hold); ``None`` with ``reason`` when it is
    not known."""

    bytes: int | None
    method: str = ""  # PER_PROCESS or DEVICE_DELTA; empty when unknown
    per_device: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reason: str = ""


def load_memory(uuids: Sequence[str], pids: Collection[int], after: Mapping[str, DeviceMemory],
                before: Mapping[str, DeviceMemory] | None = None, *, delta_spoiled: str = "") -> LoadMemory:
    """The device memory an engine (its processes ``pids``) took on each of ``uuids``, read once it
    is ready (``after``): per process where the driver reports the engine's processes on every one
    of its devices, else each device's used memory after the load less before it (``before``, read
    before the engine started). ``delta_spoiled`` says why the delta cannot be trusted (another
    engine started or stopped on those devices meanwhile). A device without a figure makes the
    whole measurement unknown: half a measurement would calibrate low."""
    if not uuids:
        return LoadMemory(None, reason="the engine has no GPU")
    per_process = {}
    for uuid in uuids:
        device = after.get(uuid)
        if device is None or device.processes is None:
            break
        figures = [device.processes[pid] for pid in pids if pid in device.processes]
        if not figures or any(figure is None for figure in figures):
            break
        per_process[uuid] = sum(figures)
    else:
        if all(per_process.values()):
            return LoadMemory(max(per_process.values()), PER_PROCESS, per_process)
    why_not_process = "the driver does not report the engine's processes' memory"
    if before is None:
        return LoadMemory(None, reason=f"{why_not_process}, and the devices were not read before the load")
    if delta_spoiled:
        return LoadMemory(None, reason=f"{why_not_process}, and the device delta cannot be trusted: {delta_spoiled}")
    deltas = {}
    for uuid in uuids:
        then, now = before.get(uuid), after.get(uuid)
        if then is None or now is None or then.used_bytes is None or now.used_bytes is None:
            return LoadMemory(None, reason=f"{why_not_process}, and {uuid}'s used memory was not read "
                                           "before and after the load")
        if now.used_bytes <= then.used_bytes:
            return LoadMemory(None, reason=f"{why_not_process}, and {uuid}'s used memory did not grow "
                                           "over the load (something else freed memory meanwhile)")
        deltas[uuid] = now.used_bytes - then.used_bytes
    return LoadMemory(max(deltas.values()), DEVICE_DELTA, deltas)


# --- classes ----------------------------------------------------------------------------------

_MARKETED_GB = (4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 144, 180, 192, 288)
_VENDOR_WORDS = {"nvidia", "tesla", "geforce"}
_SERIES_WORDS = {"rtx", "quadro", "titan", "gtx"}


def gpu_class(name: str, memory_total_bytes: int | None) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``h100-80g``; ``NVIDIA L40S`` with 45 GiB → ``l40s-48g``.

    The size is the marketed one: from the name when it says (``80GB``), else the smallest
    marketed size at or above what the card reports (cards report a little less than marketed).
    """
    words = [w for w in re.split(r"[\s\-_]+", name.strip()) if w and w.lower() not in _VENDOR_WORDS]
    model = ""
    if words:
        model = words[0].lower()
        if model in _SERIES_WORDS and len(words) > 1:
            model += words[1].lower()
    model = re.sub(r"[^a-z0-9]", "", model) or "gpu"
    size = re.search(r"(\d+)\s*GB", name, re.IGNORECASE)
    if size:
        gigabytes = int(size.group(1))
    elif memory_total_bytes:
        reported = memory_total_bytes / 2**30
        gigabytes = next((gb for gb in _MARKETED_GB if gb >= reported * 0.98), round(reported))
    else:
        return model
    return f"{model}-{gigabytes}g"


def mig_class(card_class: str, profile: str) -> str:
    return f"{card_class}-mig-{profile}" if profile else f"{card_class}-mig-unknown"
