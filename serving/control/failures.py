"""A replica that failed: its engine removed, its log tail kept, what it held given back, and what
the failure teaches — a step down the model's recovery ladder, an out-of-memory record for the
estimator — and what a load that went well teaches (calibration)."""

from __future__ import annotations

import logging
from typing import Any

from berth.errors import BerthError
from scheduler import memory, recovery_service
from scheduler.estimation.reading import read_model
from scheduler.models import Accelerator, CalibrationRecord
from scheduler.nvml import LoadMemory
from scheduler.policy import recovery
from scheduler.policy.calibration import ExitClassification
from serving.deployments import states
from serving.deployments.states import accelerators_of
from serving.engines.registry import estimation_config
from serving.models import Deployment, DeploymentState as S, ModelEntry, Replica
from serving.runtimes.base import Exit

log = logging.getLogger(__name__)


def record(replica: Replica, message: str, *, log_tail: str = "", exit: Exit | None = None,
           launch_failure: str = "") -> bool:
    """Record the failure: the replica failed with its engine's log tail (the node sent it, having
    stopped the engine), what it held given back; an OOM taught to the estimator.

    ``launch_failure`` says the replica never became ready and how: "crash" (the engine exited
    while loading, or the runtime could not start it; an exit with out-of-memory evidence makes it
    "oom") or "hang" (not ready within the start-up timeout). The recovery ladder counts those;
    the rest (no room at its turn, the queue timeout, an agent restart, a stop) are not the
    model's fault and leave it alone. False when another worker moved the replica first."""
    moved = states.move(replica, S.FAILED, message, log_tail=log_tail, exit_reason=message[:300])  # gives back
    if moved:
        if exit is not None and exit.out_of_memory:
            _record_oom(replica, exit)
        if launch_failure:
            _note_launch_failure(replica, "oom" if exit is not None and exit.out_of_memory else launch_failure,
                                 message)
    return moved


def _note_launch_failure(replica: Replica, kind: str, message: str) -> None:
    """One step down the model's recovery ladder, when the deployment serves a catalog model (only
    those are placed by the policy; a deployment made by hand under another name is not counted)."""
    name = replica.deployment.name
    entry = ModelEntry.objects.filter(name=name).values("fingerprint", "fallbacks").first()
    if entry is None:
        return
    fallbacks = entry["fallbacks"] or ()
    known = set(ModelEntry.objects.filter(name__in=fallbacks).values_list("name", flat=True))
    recovery_service.note_failure(name, kind, message, entry["fingerprint"],
                                  fallback=bool(recovery.usable_fallbacks(name, fallbacks, known)))


def calibrate(replica: Replica, peak: int | None, gpu: LoadMemory | None = None) -> None:
    """Teach the estimator what this load really used: on the CPU its peak resident memory
    (``peak``), on a GPU the device memory NVML measured (``gpu``: the engine's processes' own
    figures, else the devices' use before and after the load), recorded with which one it was.

    The reference is the estimator's own figure for the launch, before calibration — not the
    reservation, which is already calibrated: a ratio against it comes out near 1 and cancels what
    earlier loads taught. An unknown figure records nothing (unknown is not zero). Not a load with
    a draft model: its memory is two models', and calibration records are one model's."""
    deployment = replica.deployment
    if deployment.config.get("draft_model"):
        log.info("no calibration record for %s: it loaded a draft model too", replica)
        return
    try:
        shape = read_model(deployment.model_path)  # the control plane reads its own copy
        config, device, accelerator = _launch(deployment)
        if device == "cpu":
            measured, how, why = peak, CalibrationRecord.Measurement.PEAK_RSS, "its peak resident memory was not read"
        else:
            gpu = gpu or LoadMemory(None, reason="it was not read")
            measured, how, why = gpu.bytes, gpu.method, f"its device memory is not known: {gpu.reason}"
        if not measured:
            log.info("no calibration record for %s: %s", replica, why)
            return
        memory.record_load(shape, deployment.engine, _engine_version(replica), config, device,
                           estimated_bytes=memory.uncalibrated_estimate(shape, deployment.engine, config, accelerator),
                           measured_bytes=measured, node=replica.node, measurement=how, holder=states.holder_of(replica))
    except BerthError as error:
        log.warning("no calibration record for %s: %s", replica, error.message)


def _launch(deployment: Deployment) -> tuple[Any, str, Accelerator | None]:
    """The deployment's configuration as the estimator read it, the device its estimate is keyed by
    ("cpu", or the first accelerator's class) and that accelerator: as ``deploy`` estimated it."""
    accelerators = accelerators_of(deployment)
    accelerator = accelerators[0] if accelerators else None
    config = memory.engine_config(deployment.engine, estimation_config(deployment.engine, deployment.config,
                                                                       len(deployment.gpu_uuids)))
    return config, memory.device_of(deployment.engine, config, accelerator), accelerator


def _engine_version(replica: Replica) -> str:
    """The node's engine version: calibration records are keyed by it, so loads and failures meet."""
    engine = replica.node.engines.filter(kind=replica.deployment.engine).first()
    return engine.version if engine else ""


def _record_oom(replica: Replica, exit: Exit) -> None:
    deployment = replica.deployment
    if deployment.config.get("draft_model"):
        return  # two models' memory: not evidence about either one's estimate (the ladder still counts it)
    try:
        shape = read_model(deployment.model_path)  # the control plane reads its own copy
        config, device, _accelerator = _launch(deployment)  # keyed as its estimates are, so they meet
        source = "docker" if "docker" in (exit.oom_evidence or "").lower() else "kernel"
        memory.record_failure(shape, deployment.engine, _engine_version(replica), config, device,
                              estimated_bytes=deployment.memory_reserved_bytes or 1,
                              classification=ExitClassification("oom", exit.oom_evidence or "", source),
                              node=replica.node)
    except BerthError as error:
        log.warning("no OOM record for %s: %s", replica, error.message)
