"""The scheduler's memory verbs: estimates (calibrated), fit checks, reservations under a lock,
and calibration records. Views, API, commands and tasks call these."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum

from scheduler import locks
from scheduler.errors import (
    InsufficientMemory,
    InvalidCalibration,
    InvalidEstimateRequest,
    ModelOutsideRoots,
    ModelQuarantined,
    NotPlaceable,
)
from scheduler.estimation.engines import (
    Estimate,
    LlamaCppConfig,
    Part,
    VllmConfig,
    estimate_llamacpp,
    estimate_vllm,
    vllm_utilisation,
)
from scheduler.estimation.reading import read_model
from scheduler.estimation.shape import ModelShape
from scheduler.models import Accelerator, CalibrationRecord, MemoryReservation, Node
from scheduler.policy import calibration, fit as fitting
from tenancy import audit

GIB = 2**30
ENGINES = ("llamacpp", "vllm")


def quarantine_root() -> Path:
    """Where the mirror sets aside files that failed verification: under the first model root, so it
    is on the same disk, and refused by ``allowed_model_path`` whoever names it."""
    return Path(settings.SCHEDULER_MODEL_ROOTS[0]) / ".quarantine"


def allowed_model_path(path: str | Path) -> Path:
    """A model path inside one of ``SCHEDULER_MODEL_ROOTS`` and outside the mirror's quarantine;
    anything else is refused."""
    if not str(path).strip():
        raise InvalidEstimateRequest("Name a model file or folder.", details={"model_path": "Required."})
    resolved = Path(path).expanduser().resolve()
    quarantine = quarantine_root().resolve()
    if resolved == quarantine or quarantine in resolved.parents:
        raise ModelQuarantined(f"{path} is in the mirror's quarantine (it failed verification): it is never served.",
                               details={"model_path": str(path)})
    for root in settings.SCHEDULER_MODEL_ROOTS:
        if resolved == root or root in resolved.parents:
            return resolved
    raise ModelOutsideRoots(f"{path} is outside the model directories Berth reads.",
                            details={"model_path": str(path), "roots": [str(r) for r in settings.SCHEDULER_MODEL_ROOTS]})


def engine_config(engine: str, values: dict[str, Any] | None = None):
    values = dict(values or {})
    kinds = {"llamacpp": LlamaCppConfig, "vllm": VllmConfig}
    if engine not in kinds:
        raise InvalidEstimateRequest(f"Unknown engine {engine!r}.", details={"engine": f"One of {', '.join(ENGINES)}."})
    cls = kinds[engine]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InvalidEstimateRequest(f"Unknown {engine} settings: {', '.join(unknown)}.",
                                     details={name: "Not a setting of this engine." for name in unknown})
    config = cls(**{k: v for k, v in values.items() if v is not None})
    config.validate()
    return config


def draft_estimate(draft_path: str | Path, engine: str, config, accelerator: Accelerator | None = None, *,
                   check_root: bool = True) -> tuple[Estimate, str]:
    """The estimate of a speculative-decoding draft run with the model's ``config`` (the same
    context, slots and GPU offload), and the draft's name. Not calibrated: calibration records are
    per model, and a load with a draft is not one model's."""
    shape = read_model(allowed_model_path(draft_path) if check_root else Path(draft_path))
    return raw_estimate(shape, engine, config, accelerator), shape.name


def draft_bytes(draft: Estimate) -> int:
    """What a draft adds to the engine it rides in: its weights, KV cache and compute buffers on
    the same device — not a second process overhead."""
    return draft.weights_bytes + draft.kv_cache_bytes + draft.compute_bytes


def with_draft(estimate: Estimate, draft: Estimate, name: str) -> Estimate:
    """A model's estimate with its draft in the same engine, the draft as a part of its own."""
    added = draft_bytes(draft)
    part = Part("draft", added, f"draft model {name or '?'}: weights {draft.weights_bytes:,} + KV cache "
                                f"{draft.kv_cache_bytes:,} + compute {draft.compute_bytes:,} bytes")
    return dataclasses.replace(estimate, total_bytes=estimate.total_bytes + added, parts=estimate.parts + (part,),
                               host_bytes=estimate.host_bytes + draft.host_bytes,
                               inputs={**estimate.inputs, "draft": {"name": name, "bytes": added}})


def device_of(engine: str, config, accelerator: Accelerator | None) -> str:
    if engine == "llamacpp" and config.n_gpu_layers == 0:
        return "cpu"
    return accelerator.accelerator_class if accelerator is not None else "gpu"


def raw_estimate(shape: ModelShape, engine: str, config, accelerator: Accelerator | None = None) -> Estimate:
    if engine == "llamacpp":
        return estimate_llamacpp(shape, config)
    return estimate_vllm(shape, config, accelerator.memory_total_bytes if accelerator else None)


def observations(model_key: str, engine: str, engine_version: str, device: str) -> list[calibration.Observation]:
    rows = CalibrationRecord.objects.filter(model_key=model_key, engine=engine, engine_version=engine_version,
                                            device=device).order_by("-created_at", "-id")[:100]
    # Plain values: a deploy reads these up to twice, and whole rows cost more than the estimate itself.
    return [calibration.Observation(config=config, estimated_bytes=estimated, measured_bytes=measured,
                                    outcome=outcome, record_id=str(public_id))
            for config, estimated, measured, outcome, public_id in rows.values_list(
                "config", "estimated_bytes", "measured_bytes", "outcome", "public_id")]


def calibrated_estimate(shape: ModelShape, engine: str, config, *, engine_version: str = "",
                        accelerator: Accelerator | None = None) -> Estimate:
    estimate = raw_estimate(shape, engine, config, accelerator)
    device = device_of(engine, config, accelerator)
    found = observations(shape.model_key, engine, engine_version, device)
    if not found:
        return estimate
    # vLLM fills the pool it is given (--gpu-memory-utilization follows the reservation), so what a
    # load of it measures is its reservation, not what the model needs: learning from that would
    # raise every next reservation by the margin. Only its out-of-memory failures teach.
    calibrated = calibration.calibrate(
        estimate, config.calibration_key(shape), found,
        margin=settings.SCHEDULER_CALIBRATION_MARGIN_PERCENT / 100, oom_raise=settings.SCHEDULER_OOM_RAISE_PERCENT / 100,
        separate=config.calibration_separate, learns_from_loads=engine != "vllm")
    if engine == "vllm" and calibrated is not estimate and accelerator is not None and accelerator.memory_total_bytes:
        # The pool follows the calibrated reservation, and so does the KV cache it leaves.
        total = accelerator.memory_total_bytes
        utilisation = vllm_utilisation(calibrated.total_bytes, total)
        pool = int(utilisation * total)
        room = max(0, pool - (estimate.total_bytes - estimate.kv_cache_bytes))
        vllm = dict(calibrated.vllm or {}, gpu_memory_utilization=utilisation, pool_bytes=pool, kv_cache_bytes=room,
                    kv_cache_tokens=int(room // calibrated.kv_bytes_per_token) if calibrated.kv_bytes_per_token else 0)
        calibrated = dataclasses.replace(calibrated, vllm=vllm)
    return calibrated


# --- budgets -----------------------------------------------------------------------------------

def budget_for(node: Node, accelerator: Accelerator | None = None, *, exclude_holder: str = "",
               freeing: Sequence[str] = ()) -> fitting.Budget | None:
    """The memory budget of a node's RAM (CPU work, unified memory) or of one accelerator.
    ``None`` when its total was never measured: nothing can be fitted against an unknown.

    ``freeing``: holders about to give their memory back (a switch fits B where A still runs):
    their reservations, every shard's, count as free. What they measurably use stays accounted for
    by them, so it is not mistaken for use outside Berth that would stay."""
    reservations = MemoryReservation.objects.filter(node=node)
    if exclude_holder:
        reservations = reservations.exclude(holder=exclude_holder)
    leaving = Q(pk__in=[])
    for holder in freeing:
        leaving |= Q(holder=holder) | Q(holder__startswith=f"{holder}#")
    if accelerator is None:
        total = node.memory_total_bytes
        if total is None:
            return None
        reservations = reservations.filter(accelerator__isnull=True)
        used = None if node.memory_available_bytes is None else max(0, total - node.memory_available_bytes)
        margin = settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB * GIB
        label = f"{node.name} memory"
    else:
        total = accelerator.memory_total_bytes
        if total is None:
            return None
        reservations = reservations.filter(accelerator=accelerator)
        used = accelerator.memory_used_bytes
        margin = fitting.safety_margin(total, unified_memory=node.unified_memory,
                                       unified_bytes=settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB * GIB,
                                       gpu_percent=settings.SCHEDULER_SAFETY_MARGIN_GPU_PERCENT)
        label = str(accelerator)
    accounted = reservations.aggregate(s=Sum("bytes"))["s"] or 0
    freed = (reservations.filter(leaving).aggregate(s=Sum("bytes"))["s"] or 0) if freeing else 0
    # What Berth's replicas use is, as far as the scheduler knows, what they reserved.
    return fitting.Budget(total_bytes=total, reserved_bytes=accounted - freed, measured_used_bytes=used,
                          accounted_bytes=accounted, safety_margin_bytes=margin, label=label)


@dataclasses.dataclass(frozen=True)
class EstimateResult:
    shape: ModelShape
    engine: str
    config: Any
    estimate: Estimate
    fit: fitting.Fit | None
    device: str
    notes: tuple[str, ...] = ()


def estimate_and_fit(model_path: str | Path, engine: str, config_values: dict[str, Any] | None = None, *,
                     engine_version: str | None = None, node: Node | None = None,
                     accelerator: Accelerator | None = None, residents: Sequence[fitting.Resident] = (),
                     variants: Sequence[tuple[str, str]] = (), priority: int = 0,
                     check_root: bool = True, draft_path: str | Path | None = None,
                     freeing: Sequence[str] = ()) -> EstimateResult:
    """Will this fit, and what is it made of: the calibrated estimate, and with a node (or one of
    its accelerators) the fit and, if it does not fit, plans. ``draft_path``: a speculative-decoding
    draft that rides in the same engine (``with_draft``): both fit, or neither. ``freeing``: holders
    whose memory counts as free (``budget_for``)."""
    path = allowed_model_path(model_path) if check_root else Path(model_path)
    config = engine_config(engine, config_values)
    shape = read_model(path)
    if accelerator is not None and node is not None and accelerator.node_id != node.pk:
        raise InvalidEstimateRequest("That accelerator is not on that node.", details={"accelerator": "Not on the node."})
    node = node or (accelerator.node if accelerator is not None else None)
    if engine_version is None:
        engine_version = ""
        if node is not None:
            installed = next((e for e in node.engines.all() if e.kind == engine), None)
            engine_version = installed.version if installed else ""
    estimate = calibrated_estimate(shape, engine, config, engine_version=engine_version, accelerator=accelerator)
    if draft_path is not None:
        estimate = with_draft(estimate, *draft_estimate(draft_path, engine, config, accelerator, check_root=check_root))
    device = device_of(engine, config, accelerator)
    notes: list[str] = []
    fit = None
    if node is not None:
        if engine == "vllm" and accelerator is None:
            raise InvalidEstimateRequest("vLLM runs on a GPU: name the accelerator to fit it to.",
                                         details={"accelerator": "Required for vLLM."})
        on_gpu = device != "cpu" and accelerator is not None
        budget = budget_for(node, accelerator if on_gpu else None, freeing=freeing)
        if budget is None:
            notes.append("The memory total was never measured: the fit cannot be checked.")
        else:
            context = estimate.context_tokens

            def re_estimate(patched):
                return calibrated_estimate(shape, engine, patched, engine_version=engine_version, accelerator=accelerator)

            candidates = (fitting.llamacpp_candidates(config, re_estimate, context) if engine == "llamacpp"
                          else fitting.vllm_candidates(config, re_estimate, context))
            for label, variant_path in variants:
                variant_shape = read_model(allowed_model_path(variant_path) if check_root else variant_path)
                variant_estimate = calibrated_estimate(variant_shape, engine, config, engine_version=engine_version,
                                                       accelerator=accelerator)
                candidates.append(fitting.Candidate("variant", f"variant {label}", variant_estimate.total_bytes, 6,
                                                    variant=str(variant_path)))
            fit = fitting.plan_fit(budget, estimate.total_bytes, candidates=candidates, residents=residents,
                                   priority=priority)
            if device == "cpu" and estimate.host_bytes == 0 and accelerator is not None:
                notes.append("This configuration runs on the CPU: it was fitted to the node's memory.")
    return EstimateResult(shape=shape, engine=engine, config=config, estimate=estimate, fit=fit, device=device,
                          notes=tuple(notes))


# --- reservations ------------------------------------------------------------------------------

def reserve_memory(node: Node, holder: str, bytes_needed: int, *, accelerator: Accelerator | None = None,
                   residents: Sequence[fitting.Resident] = (), description: str = "") -> MemoryReservation:
    """Claim memory on a node (or one accelerator) for ``holder``, or refuse with the fit and plans.

    The check and the claim happen under the node's row lock (and the accelerator's), so two
    deploys cannot both claim the same free memory: the second waits, then sees the first's row.
    Reserving again for the same holder replaces its figure (its old one does not count against it).
    """
    if bytes_needed <= 0:
        raise InvalidEstimateRequest("A reservation needs a positive number of bytes.")
    with transaction.atomic():
        node, accelerator = locks.lock_budget(node, accelerator)
        if node.state != Node.State.READY:
            raise NotPlaceable(f"Node {node.name} is {node.get_state_display().lower()}: no new work goes there.",
                               details={"state": node.state})
        if accelerator is not None and not accelerator.placeable:
            raise NotPlaceable(f"{accelerator} cannot take work: {accelerator.unplaceable_reason}",
                               details={"reason": accelerator.unplaceable_reason})
        budget = budget_for(node, accelerator, exclude_holder=holder)
        if budget is None:
            raise NotPlaceable("The memory total was never measured: nothing can be reserved against it.")
        fit = fitting.plan_fit(budget, bytes_needed, residents=residents)
        if not fit.fits:
            raise InsufficientMemory(
                f"Not enough memory on {budget.label}: {bytes_needed / GIB:,.2f} GiB needed, "
                f"{max(0, fit.free_for_new_bytes) / GIB:,.2f} GiB free for new work.", details=fit.as_dict())
        reservation, _ = MemoryReservation.objects.update_or_create(
            holder=holder, defaults={"node": node, "accelerator": accelerator, "bytes": bytes_needed,
                                     "description": description})
    return reservation


def shard_holder(holder: str, index: int) -> str:
    """The holder name of a tensor-parallel replica's shard: the first shard is the replica's own."""
    return holder if index == 0 else f"{holder}#{index}"


def base_holder(holder: str) -> str:
    return holder.split("#", 1)[0]


def reserve_shards(node: Node, holder: str, bytes_each: int, accelerators: Sequence[Accelerator | None], *,
                   description: str = "") -> list[MemoryReservation]:
    """Claim ``bytes_each`` on every one of ``accelerators`` (one node's; a tensor-parallel replica
    holds a shard on each), all or none: one refusal undoes the others. ``[None]`` is the node's RAM."""
    with transaction.atomic():
        return [reserve_memory(node, shard_holder(holder, index), bytes_each, accelerator=accelerator,
                               description=description)
                for index, accelerator in enumerate(accelerators or [None])]


def release_reservation(holder: str) -> bool:
    """Give back what ``holder`` holds: its reservation and those of its other shards."""
    deleted, _ = MemoryReservation.objects.filter(Q(holder=holder) | Q(holder__startswith=f"{holder}#")).delete()
    return bool(deleted)


# --- calibration records -------------------------------------------------------------------------

def _canonical(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))[:512]


def record_load(shape: ModelShape, engine: str, engine_version: str, config, device: str, *,
                estimated_bytes: int, measured_bytes: int, node: Node | None = None, measurement: str = "",
                holder: str = "") -> CalibrationRecord:
    """A successful load: what the engine really used (peak resident memory on the CPU, device
    memory on a GPU) against what was estimated, for later estimates of the same key.

    ``estimated_bytes`` is the estimator's own figure for the launch (``uncalibrated_estimate``),
    not the reservation: that one is already calibrated, and a ratio against it comes out near 1
    and cancels what earlier loads taught. ``measurement`` says how ``measured_bytes`` was read
    (``CalibrationRecord.Measurement``); ``holder`` is the reservation holder whose load it was."""
    if measured_bytes is None or measured_bytes <= 0 or estimated_bytes <= 0:
        raise InvalidCalibration("A load record needs the estimate and a measured figure above zero.",
                                 details={"measured_bytes": measured_bytes, "estimated_bytes": estimated_bytes})
    if measurement and measurement not in CalibrationRecord.Measurement.values:
        raise InvalidCalibration(f"Unknown measurement {measurement!r}.",
                                 details={"measurement": f"One of {', '.join(CalibrationRecord.Measurement.values)}."})
    key = config.calibration_key(shape)
    return CalibrationRecord.objects.create(
        model_key=shape.model_key, model_name=shape.name, engine=engine, engine_version=engine_version, device=device,
        config=key, config_key=_canonical(key), estimated_bytes=estimated_bytes, measured_bytes=measured_bytes,
        outcome=CalibrationRecord.Outcome.LOADED, node=node, measurement=measurement, holder=holder)


def uncalibrated_estimate(shape: ModelShape, engine: str, config, accelerator: Accelerator | None = None) -> int:
    """The estimator's own figure for a launch, before any calibration: the reference a load's
    measurement is recorded against, so its ratio means the same as the estimate it later scales."""
    return raw_estimate(shape, engine, config, accelerator).total_bytes


def load_measurements(holders: Sequence[str]) -> dict[str, CalibrationRecord]:
    """The newest load record of each of ``holders`` (replicas): what its load measured, and how."""
    found: dict[str, CalibrationRecord] = {}
    if holders:
        for record in CalibrationRecord.objects.filter(holder__in=list(holders),
                                                       outcome=CalibrationRecord.Outcome.LOADED):
            found.setdefault(record.holder, record)  # newest first (the model's ordering)
    return found


def record_failure(shape: ModelShape, engine: str, engine_version: str, config, device: str, *,
                   estimated_bytes: int, classification: calibration.ExitClassification,
                   measured_bytes: int | None = None, node: Node | None = None) -> CalibrationRecord | None:
    """A failed load. Recorded (and later estimates raised) only when it ran out of memory with
    evidence; a plain SIGKILL or a crash records nothing."""
    if not classification.is_oom:
        return None
    key = config.calibration_key(shape)
    return CalibrationRecord.objects.create(
        model_key=shape.model_key, model_name=shape.name, engine=engine, engine_version=engine_version, device=device,
        config=key, config_key=_canonical(key), estimated_bytes=estimated_bytes, measured_bytes=measured_bytes,
        outcome=CalibrationRecord.Outcome.OOM, evidence=f"{classification.source}: {classification.evidence}"[:4000],
        node=node)


def reset_calibration(records, actor: audit.Actor) -> int:
    """Forget calibration records (a queryset); later estimates go back to the formulas."""
    with transaction.atomic():
        rows = list(records.select_for_update().values_list("public_id", "model_name", "engine"))
        count = len(rows)
        if count:
            records.model.objects.filter(public_id__in=[r[0] for r in rows]).delete()
            audit.record(actor, "calibration.reset", CalibrationRecord(),
                         details={"count": count, "models": sorted({r[1] for r in rows})[:20]})
    return count
