"""Liveness and readiness for load balancers and orchestrators.

``/healthz`` says the process answers. ``/readyz`` says it can do useful work: the database
answers a query, the Celery broker accepts a connection, and the control loop has passed lately
(its pass, run by a worker on beat's schedule, writes ``LAST_PASS_KEY``; stale after
``MISSED_PASSES`` missed passes). Apps add checks at start-up with ``register`` (serving adds the
agents seen, for information). Neither view needs a login and neither reveals more than which
dependency is down, how long ago the loop passed, and which process holds the loop's lease
(``berth.lease``: the one process that runs the periodic pass) and for how long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from berth import broker, lease

log = logging.getLogger(__name__)

# Cache keys read by name (this module imports no app): serving.control.reconcile writes the first
# after each pass, serving.control.placement holds the second while a pass (of anyone's) runs.
LAST_PASS_KEY = "berth:control:last-pass"
PASS_LOCK_KEY = "berth:placement:pass"
CONTROL_TASK = "serving.reconcile"
MISSED_PASSES = 3
# A loop that never ran yet is "starting", not stale, for MISSED_PASSES intervals from this process's start.
STARTED_AT = time.time()

# name -> (check, required): a check returns (status, detail); "ok" is healthy, anything else fails
# readiness when the check is required, and is only reported when it is not.
_registered: dict[str, tuple[Callable[[], tuple[str, dict]], bool]] = {}


def register(name: str, check: Callable[[], tuple[str, dict]], *, required: bool = True) -> None:
    """Add a readiness check (apps call it from ``AppConfig.ready``); a name registered again is replaced."""
    _registered[name] = (check, required)


def pass_interval() -> float | None:
    """Seconds between control-loop passes in ``CELERY_BEAT_SCHEDULE``; None when beat does not schedule it."""
    for entry in settings.CELERY_BEAT_SCHEDULE.values():
        if entry.get("task") == CONTROL_TASK:
            schedule = entry["schedule"]
            return schedule.total_seconds() if isinstance(schedule, timedelta) else float(schedule)
    return None


def control_loop(now: float | None = None, started_at: float | None = None) -> tuple[str, dict]:
    """The control loop's state: ``ok``, ``starting`` (never ran, and ``started_at`` — this process's
    start by default — is under three intervals ago), ``stale``, ``never_ran``, ``not_scheduled``; with
    the last pass's age, whether a pass runs now, and the lease: its holder (host:pid), how long that
    holder has held it, when it last renewed it, and whether it has expired (None until first taken)."""
    now = time.time() if now is None else now
    started_at = STARTED_AT if started_at is None else started_at
    interval = pass_interval()
    if interval is None:
        return "not_scheduled", {"task": CONTROL_TASK}
    stale_after = MISSED_PASSES * interval
    last, running = cache.get(LAST_PASS_KEY), cache.get(PASS_LOCK_KEY)
    held = lease.read(lease.CONTROL_LOOP)
    detail = {"pass_interval_s": interval, "stale_after_s": stale_after,
              "last_pass_age_s": None if last is None else round(now - float(last), 1),
              "pass_running": running is not None, "holder": held.holder if held else None,
              "lease_age_s": round(held.age_s, 1) if held else None,
              "lease_renewed_age_s": round(held.renewed_age_s, 1) if held else None,
              "lease_expired": held.expired if held else None}
    if last is None:
        return ("starting" if now - started_at < stale_after else "never_ran"), detail
    return ("ok" if now - float(last) <= stale_after else "stale"), detail


PASSING = {"ok", "starting"}  # a loop that has not had time to pass yet does not fail readiness


@never_cache
@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request):
    checks = {"database": _probe(_database), "broker": _probe(broker.check)}
    details, required = {}, {"database", "broker"}
    for name, (check, must) in {"control_loop": (control_loop, True), **_registered}.items():
        checks[name], detail = _run(name, check)
        if detail:
            details[name] = detail
        if must:
            required.add(name)
    failing = sorted(name for name in required if checks[name] not in PASSING)
    body = {"status": "not_ready" if failing else "ready", "checks": checks, "details": details}
    if failing:
        body["failing"] = failing
    return JsonResponse(body, status=503 if failing else 200)


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _run(name: str, check) -> tuple[str, dict]:
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is down; the reason goes to the log only
        log.warning("readiness check %s failed: %s", name, exc)
        return "unavailable", {}


def _probe(check) -> str:
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"; the reason goes to the log only
        log.warning("readiness check %s failed: %s", check.__name__, exc)
        return "unavailable"
    return "ok"
