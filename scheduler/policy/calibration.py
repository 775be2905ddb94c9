"""Calibration from measured loads, and what counts as evidence of running out of memory.

Pure: the caller gathers the records for one (model, engine, engine version, device) and passes
them newest first; ``calibrate`` returns the estimate the planner should use, saying why.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
from typing import Any, Sequence

from scheduler.estimation.engines import Estimate


@dataclasses.dataclass(frozen=True)
class Observation:
    config: dict[str, Any]
    estimated_bytes: int
    measured_bytes: int | None
    outcome: str  # "loaded" or "oom"
    record_id: str = ""


def calibrate(estimate: Estimate, config: dict[str, Any], observations: Sequence[Observation], *,
              margin: float = 0.05, oom_raise: float = 0.25, separate: Sequence[str] = (),
              learns_from_loads: bool = True) -> Estimate:
    """The estimate after what earlier loads of the same model, engine and version measured.

    * A load with exactly this configuration: its measurement plus ``margin`` replaces the figure.
    * Loads with other configurations only: the newest one's measured ÷ estimated ratio scales
      this estimate (it raises or lowers it). ``estimated_bytes`` is the estimator's own figure for
      that load, before calibration, like ``estimate`` here. Only a load that agrees on every
      setting in ``separate`` is a neighbour (flash attention on and off never calibrate each other).
    * An out-of-memory failure (recorded only with evidence) with this configuration, newer than
      any successful load of it: the figure is at least what was tried plus ``oom_raise``.

    ``learns_from_loads=False``: successful loads teach nothing, only out-of-memory failures do —
    for an engine that takes whatever it is given, whose measured use is its reservation.
    """
    if not learns_from_loads:
        observations = [o for o in observations if o.outcome != "loaded"]
    exact = [o for o in observations if o.config == config]
    loaded_exact = next((o for o in exact if o.outcome == "loaded" and o.measured_bytes), None)
    total, rule, detail, used = estimate.total_bytes, None, "", []
    if loaded_exact is not None:
        total = math.ceil(loaded_exact.measured_bytes * (1 + margin))
        rule, used = "measured", [loaded_exact.record_id]
        detail = (f"measured {loaded_exact.measured_bytes:,} B with this configuration, plus a {margin:.0%} margin")
    else:
        neighbour = next((o for o in observations if o.outcome == "loaded" and o.measured_bytes
                          and o.estimated_bytes > 0 and o.config != config
                          and all(o.config.get(name) == config.get(name) for name in separate)), None)
        if neighbour is not None:
            ratio = neighbour.measured_bytes / neighbour.estimated_bytes
            total = math.ceil(estimate.total_bytes * ratio)
            rule, used = "ratio", [neighbour.record_id]
            detail = f"a neighbouring configuration measured {ratio:.3f}× its estimate"
    newer_ooms = []
    for observation in exact:
        if observation is loaded_exact:
            break
        if observation.outcome == "oom":
            newer_ooms.append(observation)
    if newer_ooms:
        tried = max(max(o.estimated_bytes, o.measured_bytes or 0) for o in newer_ooms)
        floor = math.ceil(tried * (1 + oom_raise))
        if floor > total:
            total = floor
            rule = "oom" if rule is None else f"{rule}+oom"
            used += [o.record_id for o in newer_ooms]
            detail = (detail + "; " if detail else "") + (
                f"ran out of memory with {tried:,} B ({len(newer_ooms)} time(s)): raised by {oom_raise:.0%}")
    if rule is None:
        return estimate
    return dataclasses.replace(
        estimate, total_bytes=total, uncalibrated_total_bytes=estimate.total_bytes,
        calibration={"rule": rule, "detail": detail, "records": [r for r in used if r],
                     "adjustment_bytes": total - estimate.total_bytes})


# --- out-of-memory evidence ----------------------------------------------------------------------

_KERNEL_OOM = (
    re.compile(r"(?:Memory cgroup )?[Oo]ut of memory: Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)"),
    re.compile(r"oom-kill:.*task=(?P<name>[^,]+),pid=(?P<pid>\d+)"),
    re.compile(r"oom_reaper: reaped process (?P<pid>\d+) \((?P<name>[^)]*)\)"),
)
_ENGINE_OOM = re.compile(
    r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory|cudaMalloc failed: out of memory"
    r"|ggml_backend_cuda_buffer_type_alloc_buffer: allocating [\d.]+ MiB on device \d+: cudaMalloc failed"
    r"|failed to allocate (?:CUDA|CPU)\d* buffer",
    re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ExitClassification:
    kind: str  # "oom", "killed", "crashed", "exited"
    evidence: str  # the line that proves it; empty without evidence
    source: str  # "kernel", "docker", "engine" or ""

    @property
    def is_oom(self) -> bool:
        """Only an out-of-memory exit with evidence raises later estimates."""
        return self.kind == "oom" and bool(self.evidence)


def classify_exit(*, exit_code: int | None = None, kernel_log: str = "", engine_log: str = "",
                  docker_oom_killed: bool | None = None, pid: int | None = None) -> ExitClassification:
    """Why an engine ended. ``exit_code`` is the process's (negative: killed by that signal) or a
    container's (128 + signal). A SIGKILL is out of memory only with evidence: the kernel OOM
    killer's line naming the process, Docker's ``OOMKilled``, or the engine's own allocation
    failure. Anything else that killed it (``docker kill``, a stop timeout) is not."""
    if docker_oom_killed:
        return ExitClassification("oom", "Docker reported State.OOMKilled=true", "docker")
    for line in kernel_log.splitlines():
        for pattern in _KERNEL_OOM:
            match = pattern.search(line)
            if match and (pid is None or int(match.group("pid")) == pid):
                return ExitClassification("oom", line.strip(), "kernel")
    for line in engine_log.splitlines():
        if _ENGINE_OOM.search(line):
            return ExitClassification("oom", line.strip(), "engine")
    if exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return ExitClassification("killed", "", "")
    if exit_code in (None, 0):
        return ExitClassification("exited", "", "")
    return ExitClassification("crashed", "", "")
