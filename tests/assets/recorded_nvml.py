"""Recorded outputs of real machines, fed to the scheduler's NVML adapter.

``RecordedNvml`` answers the ``pynvml`` calls the adapter makes from a JSON recording (what each
call returned on the machine), raising ``pynvml``'s own exception classes where the recording says
the call failed; ``recorded_smi`` answers ``nvidia-smi -q -x`` and ``-L`` from their saved text.
No GPU exists here: these are the only stand-ins, and only for the GPU.
"""

from __future__ import annotations

import json
import subprocess
import types
from pathlib import Path

import pynvml

RECORDED = Path(__file__).resolve().parent.parent / "scheduler" / "recorded"

_ERRORS = {
    "NotSupported": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "GpuIsLost": pynvml.NVML_ERROR_GPU_IS_LOST,
    "NotFound": pynvml.NVML_ERROR_NOT_FOUND,
    "LibraryNotFound": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    "DriverNotLoaded": pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
}


class RecordedNvml:
    """A module-shaped object with pynvml's exceptions and constants and the recorded answers."""

    def __init__(self, recording: dict | None = None, init_error: str | None = None):
        self._recording = recording or {"devices": []}
        self._init_error = init_error
        for name in dir(pynvml):
            if name.startswith(("NVMLError", "NVML_")):
                setattr(self, name, getattr(pynvml, name))
        self.calls: list[str] = []

    @classmethod
    def load(cls, machine: str) -> "RecordedNvml":
        return cls(json.loads((RECORDED / f"{machine}.pynvml.json").read_text()))

    @classmethod
    def without_library(cls) -> "RecordedNvml":
        """A CPU-only machine: libnvidia-ml.so is not there."""
        return cls(init_error="LibraryNotFound")

    # -- plumbing
    def _fail(self, code: str):
        raise pynvml.NVMLError(_ERRORS[code])

    def _device(self, handle):
        kind, index, slot = handle
        device = self._recording["devices"][index]
        return device if kind == "gpu" else device["mig_devices"][slot]

    def _answer(self, call: str, handle, key: str):
        self.calls.append(call)
        device = self._device(handle)
        errors = device.get("errors", {})
        if call in errors:
            self._fail(errors[call])
        if "*" in errors:
            self._fail(errors["*"])
        value = device.get(key)
        if value is None:
            self._fail("NotSupported")
        return value

    # -- the calls the adapter makes
    def nvmlInit(self):
        if self._init_error:
            self._fail(self._init_error)

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return self._recording.get("driver_version", "")

    def nvmlSystemGetCudaDriverVersion(self):
        return self._recording.get("cuda_driver_version", 0)

    def nvmlDeviceGetCount(self):
        return len(self._recording["devices"])

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index, None)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append("nvmlDeviceGetHandleByUUID")
        for index, device in enumerate(self._recording["devices"]):
            if device.get("uuid") == uuid:
                return ("gpu", index, None)
            for position, mig in enumerate(device.get("mig_devices", [])):
                if mig.get("uuid") == uuid:
                    return ("mig", index, position)
        self._fail("NotFound")

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        """``processes``: what the call listed, each ``{"pid", "usedGpuMemory"}`` (``None`` where
        the driver withholds the figure, as pynvml reports it); absent: the call is not supported."""
        listed = self._answer("nvmlDeviceGetComputeRunningProcesses", handle, "processes")
        return [types.SimpleNamespace(**process) for process in listed]

    def nvmlDeviceGetName(self, handle):
        return self._answer("nvmlDeviceGetName", handle, "name")

    def nvmlDeviceGetUUID(self, handle):
        return self._answer("nvmlDeviceGetUUID", handle, "uuid")

    def nvmlDeviceGetMemoryInfo(self, handle):
        memory = self._answer("nvmlDeviceGetMemoryInfo", handle, "memory")
        return types.SimpleNamespace(**memory)

    def nvmlDeviceGetPciInfo(self, handle):
        return types.SimpleNamespace(busId=self._answer("nvmlDeviceGetPciInfo", handle, "pci_bus_id"))

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(**self._answer("nvmlDeviceGetUtilizationRates", handle, "utilization"))

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._answer("nvmlDeviceGetTemperature", handle, "temperature")

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._answer("nvmlDeviceGetPowerUsage", handle, "power_usage_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._answer("nvmlDeviceGetEnforcedPowerLimit", handle, "enforced_power_limit_mw")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._answer("nvmlDeviceGetCurrentClocksEventReasons", handle, "clocks_event_reasons")

    def nvmlDeviceGetMigMode(self, handle):
        return tuple(self._answer("nvmlDeviceGetMigMode", handle, "mig_mode"))

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return self._answer("nvmlDeviceGetMaxMigDeviceCount", handle, "max_mig_device_count")

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        _, index, _ = handle
        migs = self._recording["devices"][index].get("mig_devices", [])
        position = next((i for i, m in enumerate(migs) if m["slot"] == slot), None)
        if position is None:
            self._fail("NotFound")  # what NVML says for an empty slot
        return ("mig", index, position)

    def nvmlDeviceGetGpuInstanceId(self, handle):
        return self._answer("nvmlDeviceGetGpuInstanceId", handle, "gpu_instance_id")

    def nvmlDeviceGetComputeInstanceId(self, handle):
        return self._answer("nvmlDeviceGetComputeInstanceId", handle, "compute_instance_id")

    def nvmlDeviceGetRemappedRows(self, handle):
        return tuple(self._answer("nvmlDeviceGetRemappedRows", handle, "remapped_rows"))

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        return self._answer("nvmlDeviceGetTotalEccErrors", handle, "ecc_uncorrected_volatile")


def recorded_smi(machine: str | None):
    """An ``nvidia-smi`` runner answering from saved output; ``None``: nvidia-smi is not installed."""

    def run(args: list[str]) -> str:
        if machine is None:
            raise FileNotFoundError("nvidia-smi is not on PATH")
        if args == ["-q", "-x"]:
            return (RECORDED / f"{machine}.nvidia-smi-q-x.xml").read_text()
        if args == ["-L"]:
            path = RECORDED / f"{machine}.nvidia-smi-L.txt"
            if not path.exists():
                raise subprocess.CalledProcessError(1, ["nvidia-smi", *args])
            return path.read_text()
        raise AssertionError(f"unexpected nvidia-smi arguments {args}")

    return run
