"""The recovery ladder's memory, kept per catalog model: failed launches noted by Serving's agent,
reset by a launch that became ready or by an operator's retry, and read back as the policy's
``Snapshot.failures``.

The ladder itself is pure (``scheduler.policy.recovery``); this module only stores what it
returns. A parked model stays parked here until an operator retries it or a launch succeeds;
when its catalog definition changes the policy stops treating it as parked (the fingerprint no
longer equals ``parked_fingerprint``), and the next failure starts a fresh ladder.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from scheduler.errors import ModelNotParked
from scheduler.models import RecoveryState
from scheduler.policy import recovery
from scheduler.policy.inputs import FailureState, Settings
from scheduler.conf import policy_settings
from tenancy import audit

log = logging.getLogger(__name__)
KINDS = tuple(RecoveryState.Kind.values)


def _state(row: RecoveryState) -> FailureState:
    return FailureState(kind=row.kind, consecutive=row.consecutive,
                        last_failure_at=row.last_failure_at.timestamp() if row.last_failure_at else None,
                        level=row.level, parked=row.parked, parked_fingerprint=row.parked_fingerprint,
                        last_error=row.last_error)


def note_failure(model: str, kind: str, error: str = "", fingerprint: str = "", *, fallback: bool = False,
                 at=None, settings: Settings | None = None) -> RecoveryState:
    """One more failed launch of ``model`` (crash / oom / hang), one step down the ladder.
    ``fallback``: whether the model has a fallback in the catalog; without one, the step that would
    fall back is the minimal footprint, tried once, and the failure after it parks the model.

    Failures of an earlier definition (another fingerprint) are forgotten first: a changed model
    starts a fresh ladder."""
    if kind not in KINDS:
        raise ValueError(f"unknown launch failure kind {kind!r}; expected one of {', '.join(KINDS)}")
    now = at or timezone.now()
    settings = settings or policy_settings()
    with transaction.atomic():
        row, _ = RecoveryState.objects.select_for_update().get_or_create(model=model)
        changed = bool(fingerprint and row.fingerprint and fingerprint != row.fingerprint)
        previous = None if changed or (row.consecutive <= 0 and not row.parked) else _state(row)
        state = recovery.record_failure(previous, kind, now.timestamp(), error, settings, fingerprint,
                                       fallback=fallback)
        was_parked = row.parked and not changed
        became_parked = state.parked and not was_parked
        row.kind, row.consecutive, row.level = state.kind, state.consecutive, state.level
        row.last_failure_at, row.last_error, row.fingerprint = now, state.last_error, fingerprint
        row.parked, row.parked_fingerprint = state.parked, state.parked_fingerprint
        if became_parked:
            row.parked_at = now
        elif not state.parked:
            row.parked_at = None
        row.save()
    if became_parked:
        log.warning("model %s parked after %d launch failure(s) in a row (last: %s): %s; it is not placed again "
                    "until its definition changes or an operator retries it", model, row.consecutive, kind,
                    row.last_error or "no detail")
    return row


def note_success(model: str) -> bool:
    """A replica of ``model`` became ready: its failure memory is reset (one UPDATE, nothing when
    there is nothing to forget). True when a row was reset."""
    return bool(RecoveryState.objects.filter(model=model).filter(Q(consecutive__gt=0) | Q(parked=True)).update(
        kind="", consecutive=0, level=0, parked=False, parked_at=None, parked_fingerprint="",
        updated_at=timezone.now()))


def failure_states() -> dict[str, FailureState]:
    """Every model's failure memory as the policy reads it (``Snapshot.failures``)."""
    rows = RecoveryState.objects.filter(Q(consecutive__gt=0) | Q(parked=True))
    return {row.model: _state(row) for row in rows}


def describe(row: RecoveryState) -> dict:
    """A row as the API and the console show it (``retriable``: a retry would reset something now)."""
    why = f"parked after {row.consecutive} failure(s) in a row: {row.last_error or row.kind}" if row.parked else ""
    since = row.parked_at if row.parked else None
    return {"model": row.model, "parked": row.parked, "kind": row.kind,
            "consecutive": row.consecutive, "level": row.level, "last_error": row.last_error,
            "last_failure_at": row.last_failure_at, "since": since, "detail": why,
            "retried_by": row.retried_by, "retried_at": row.retried_at, "retriable": row.parked}


def parked_now(model: str, fingerprint: str = "") -> dict | None:
    """``model``'s row as ``describe`` shows it when the policy treats it as parked now: parked for
    the definition ``fingerprint`` (a changed definition is placed again, as ``recovery.next_step``
    decides); None otherwise. What the gateway answers a request for a parked model with."""
    row = RecoveryState.objects.filter(model=model, parked=True).first()
    if row is None or (fingerprint and row.parked_fingerprint != fingerprint):
        return None
    return describe(row)


def parked(limit: int = 200, models=None) -> list[dict]:
    """Parked models, most recently parked first; only those named in ``models`` (names, or a
    queryset of them) when given."""
    rows = RecoveryState.objects.filter(parked=True)
    if models is not None:
        rows = rows.filter(model__in=models)
    rows = rows.order_by("-parked_at", "model")[:limit]
    return [describe(row) for row in rows]


def retry(actor: audit.Actor, model: str) -> RecoveryState:
    """An operator's retry: the model's failure memory is reset so the next pass places it again."""
    with transaction.atomic():
        row = RecoveryState.objects.select_for_update().filter(model=model).first()
        if row is None or not row.parked:
            raise ModelNotParked(f"Model {model} is not parked: there is nothing to retry.", details={"model": model})
        before = {"kind": row.kind, "consecutive": row.consecutive, "level": row.level,
                  "parked_at": row.parked_at, "last_error": row.last_error[:300]}
        row.kind, row.consecutive, row.level = "", 0, 0
        row.parked, row.parked_at, row.parked_fingerprint = False, None, ""
        row.retried_by, row.retried_at = actor.written, timezone.now()
        row.save()
        audit.record(actor, "placement.retry", row, details={"model": model, "was": before})
    log.info("model %s retried by %s after %d failure(s)", model, actor.written, before["consecutive"])
    return row
