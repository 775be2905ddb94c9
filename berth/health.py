"""Liveness and readiness for load balancers and orchestrators.

``/healthz`` says the process answers. ``/readyz`` says it can do useful work: the database
answers a query and the Celery broker accepts a connection. Neither needs a login and neither
reveals more than which dependency is down.
"""

from __future__ import annotations

import logging

from django.db import connection
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from berth import broker

log = logging.getLogger(__name__)


@never_cache
@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request):
    checks = {"database": _probe(_database), "broker": _probe(broker.check)}
    ready = all(result == "ok" for result in checks.values())
    return JsonResponse({"status": "ready" if ready else "not_ready", "checks": checks},
                        status=200 if ready else 503)


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _probe(check) -> str:
    try:
        check()
    except Exception as exc:  # any failure means "not ready"; the reason goes to the log only
        log.warning("readiness check %s failed: %s", check.__name__, exc)
        return "unavailable"
    return "ok"
