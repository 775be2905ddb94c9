"""The recovery ladder for failed launches, parking, and when a placement failure is worth a log line.

A graded ladder that never retries unchanged what cannot succeed: a crash is retried with
exponential backoff a bounded number of times; out of memory relaunches degraded, then falls back
to a configured smaller model, then quarantines; a hang gets one retry, then degrades, then falls
back. A model with no fallback takes the last rung instead: one launch at the minimal footprint
(the smallest context, one slot, on the CPU where its engine can run there) before it is parked.
Severity never decreases as failures grow, and after ``park_after`` consecutive failures the
model is parked until its definition changes or an operator retries it.

Launch levels (``Step.level``, what Serving deploys, and the level kept in the failure memory):
0 the profile as configured, 1 degraded (``DEGRADE``, and a fallback's launch), 2 the minimal
footprint (``MINIMAL``). A later retry keeps the level reached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable

from scheduler.policy.inputs import DesiredModel, FailureState, Settings

RETRY, DEGRADE, FALLBACK, MINIMAL, QUARANTINE = "retry", "degrade", "fallback", "minimal", "quarantine"
# The minimal footprint is the fallback's rung for a model without one: as severe, never both.
SEVERITY = {RETRY: 0, DEGRADE: 1, FALLBACK: 2, MINIMAL: 2, QUARANTINE: 3}
FULL, DEGRADED, MINIMAL_FOOTPRINT = 0, 1, 2  # launch levels
LEVEL = {RETRY: FULL, DEGRADE: DEGRADED, FALLBACK: DEGRADED, MINIMAL: MINIMAL_FOOTPRINT}


@dataclasses.dataclass(frozen=True)
class Step:
    action: str  # retry / degrade / fallback / minimal / quarantine; "" nothing to recover from
    level: int = 0  # launch level: 0 full, 1 degraded, 2 minimal footprint
    fallback: bool = False
    not_before: float | None = None  # backoff: no launch before this time
    parked: bool = False
    reason: str = ""


def ladder(kind: str, consecutive: int, settings: Settings = Settings(), *, fallback: bool = True) -> str:
    """The step after ``consecutive`` failures of ``kind``; with no ``fallback`` to fall back to, the
    fallback step is the minimal footprint, tried once (the degraded launch has already failed: never
    retry it unchanged), and the step after it a quarantine. A crash has no degraded rung: it is
    retried, then quarantined."""
    if consecutive <= 0 or not kind:
        return ""
    if kind == "oom":
        action = (DEGRADE, FALLBACK)[consecutive - 1] if consecutive <= 2 else QUARANTINE
    elif kind == "hang":
        action = (RETRY, DEGRADE, FALLBACK)[consecutive - 1] if consecutive <= 3 else QUARANTINE
    else:
        action = RETRY if consecutive <= settings.crash_retries else QUARANTINE
    return MINIMAL if action == FALLBACK and not fallback else action


def usable_fallbacks(name: str, fallbacks: Iterable[str], known: Container[str] | None = None) -> tuple[str, ...]:
    """The configured fallbacks of model ``name`` that exist (``known``: the catalog's names; None
    trusts them all). The policy and Serving's agent, noting a failure, both ask this."""
    return tuple(f for f in fallbacks if f != name and (known is None or f in known))


def backoff(consecutive: int, settings: Settings = Settings()) -> float:
    return min(settings.max_backoff_s, settings.base_backoff_s * 2 ** max(0, consecutive - 1))


def next_step(model: DesiredModel, failure: FailureState | None, settings: Settings = Settings(),
              known: Container[str] | None = None) -> Step:
    """What to do about ``model`` given its failure memory. A parked model whose definition has
    changed (a new fingerprint) is no longer parked: the caller resets its failure state. ``known``
    (the catalog's names) decides which fallbacks exist."""
    if failure is None or (failure.consecutive <= 0 and not failure.parked):
        return Step("")
    if failure.parked and (not model.fingerprint or failure.parked_fingerprint == model.fingerprint):
        return Step(QUARANTINE, parked=True, reason=f"parked after {failure.consecutive} failures: "
                                                     f"{failure.last_error or failure.kind}")
    if failure.parked:
        return Step("")  # the definition changed: unparked
    if failure.consecutive >= settings.park_after:
        return Step(QUARANTINE, parked=True, reason=f"{failure.consecutive} failures in a row: "
                                                     f"{failure.last_error or failure.kind}")
    action = ladder(failure.kind, failure.consecutive, settings, fallback=bool(usable_fallbacks(model.id, model.fallbacks, known)))
    if action == QUARANTINE:
        return Step(QUARANTINE, parked=True, reason=f"quarantined after {failure.kind}: {failure.last_error}".rstrip(": "))
    not_before = None
    if failure.last_failure_at is not None:
        not_before = failure.last_failure_at + backoff(failure.consecutive, settings)
    if action == FALLBACK:  # another model: its own degraded launch, whatever level this one reached
        return Step(FALLBACK, level=DEGRADED, fallback=True, not_before=not_before,
                    reason=f"falling back after {failure.consecutive} {failure.kind} failure(s)")
    level = min(MINIMAL_FOOTPRINT, max(failure.level, LEVEL.get(action, FULL)))
    reason = ""
    if action == MINIMAL:
        reason = (f"minimal footprint after {failure.consecutive} {failure.kind} failure(s), the degraded relaunch "
                  f"among them, and no fallback: tried once before parking"
                  + (f" (last: {failure.last_error})" if failure.last_error else ""))
    elif action == DEGRADE:
        reason = f"degraded relaunch after {failure.consecutive} {failure.kind} failure(s)"
    return Step(action, level=level, not_before=not_before, reason=reason)


def record_failure(state: FailureState | None, kind: str, at: float, error: str = "",
                   settings: Settings = Settings(), fingerprint: str = "", *, fallback: bool = True) -> FailureState:
    """The failure memory after one more failed launch (Serving stores it). ``fallback``: whether
    the model has a fallback that exists; without one, the step that would use it is the minimal
    footprint and the failure after that parks the model here, so the stored memory says parked
    exactly when the policy treats it so. ``level`` is the launch level the next step runs at."""
    state = state or FailureState()
    consecutive = state.consecutive + 1
    action = ladder(kind, consecutive, settings, fallback=fallback)
    if state.consecutive > 0 and state.level >= MINIMAL_FOOTPRINT:
        action = QUARANTINE  # the launch that failed was the minimal footprint, whatever the kind: the last rung
    level = max(state.level, LEVEL.get(action, FULL))
    parked = consecutive >= settings.park_after or action == QUARANTINE
    return FailureState(kind=kind, consecutive=consecutive, last_failure_at=at,
                        level=min(level, MINIMAL_FOOTPRINT), parked=parked,
                        parked_fingerprint=fingerprint if parked else "", last_error=error[:500])


def record_success() -> FailureState:
    return FailureState()


def should_log(previous_reason: str | None, previous_at: float | None, reason: str, now: float,
               repeat_s: float = 600) -> bool:
    """Log an unplaceable reason only when it changes, or every ``repeat_s`` seconds."""
    if previous_reason != reason or previous_at is None:
        return True
    return now - previous_at >= repeat_s
