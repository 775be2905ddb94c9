"""The memory watchdog: after each telemetry refresh, how close is a node to running out of memory,
and — with auto-protect on — which deployment to stop before the kernel picks a victim itself.

Levels: ok; warning when MemAvailable is below 1.5 × the safety margin; critical below the margin.
A level change is logged and audited and shown as a banner in the console. By default that is all
it does: at critical it warns, at most once a minute per node, naming the deployment it would stop.
With ``BERTH_AUTO_PROTECT`` (``SERVING_AUTO_PROTECT``) on, at critical, at most once a minute per
node, the lowest-priority ready, sleeping or unknown deployment is stopped (the largest reservation
first among equals): one stop frees the most for the least harm.
"""

from __future__ import annotations

import dataclasses
import logging

from django.conf import settings
from django.core.cache import cache

from serving.deployments import service
from serving.models import Deployment
from serving.models.states import RESIDENT
from tenancy import audit
from tenancy.audit import Actor

log = logging.getLogger(__name__)
OK, WARNING, CRITICAL = "ok", "warning", "critical"
ACTOR = Actor(system="watchdog")
PROTECT_INTERVAL_SECONDS = 60


def assess(available_bytes: int | None, margin_bytes: int) -> str | None:
    """The level, or None when MemAvailable was not measured (unknown is not "ok")."""
    if available_bytes is None:
        return None
    if available_bytes < margin_bytes:
        return CRITICAL
    if available_bytes < margin_bytes * 1.5:
        return WARNING
    return OK


@dataclasses.dataclass(frozen=True)
class Candidate:
    key: str
    priority: int
    reserved_bytes: int


def choose_victim(candidates: list[Candidate]) -> Candidate | None:
    """Lowest priority first; within a priority the largest reservation; then the key, for a stable choice."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (c.priority, -c.reserved_bytes, c.key))


def _level_key(node) -> str:
    return f"berth:watchdog:level:{node.pk}"


def levels(nodes) -> dict[str, str] | None:
    """{node name: level} for the nodes with a known level (one cache round trip), or None when the
    cache cannot be read (Redis down): then no level is known, which is not "all ok". Every console
    page shows these, so a cache that is away must cost the banner, never the page."""
    nodes = list(nodes)
    try:
        found = cache.get_many([_level_key(node) for node in nodes])
    except Exception as exc:  # noqa: BLE001 - any backend's failure (Redis refusing, a file cache unreadable)
        log.warning("memory levels not known: the cache cannot be read (%s: %s)", type(exc).__name__, exc)
        return None
    return {node.name: found[_level_key(node)] for node in nodes if found.get(_level_key(node))}


def check(node) -> str | None:
    """Assess ``node`` from its latest figures; log and audit a change; protect it at critical."""
    margin = settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB * 2**30
    level = assess(node.memory_available_bytes, margin)
    previous = cache.get(_level_key(node))
    if level != previous:
        cache.set(_level_key(node), level, None)
        log.warning("memory on %s: %s → %s (%s bytes available, margin %s)", node.name, previous, level,
                    node.memory_available_bytes, margin)
        audit.record(ACTOR, "watchdog.level", node, details={"from": previous, "to": level,
                                                             "available_bytes": node.memory_available_bytes,
                                                             "margin_bytes": margin})
    if level != CRITICAL:
        return level
    deployments = {str(d.public_id): d for d in Deployment.objects.filter(node=node,
                                                                         state__in=RESIDENT)}
    victim = choose_victim([Candidate(key, d.priority, d.memory_reserved_bytes or 0) for key, d in deployments.items()])
    if not settings.SERVING_AUTO_PROTECT:
        # Only a warning, once a minute per node (cache.add is atomic): stopping is an operator's call.
        if victim is not None and cache.add(f"berth:watchdog:warned:{node.pk}", 1, PROTECT_INTERVAL_SECONDS):
            deployment = deployments[victim.key]
            log.warning("memory on %s is critical; auto-protect is off (BERTH_AUTO_PROTECT), so nothing is "
                        "stopped: it would stop %s (priority %s)", node.name, deployment.name, deployment.priority)
        return level
    # cache.add is atomic: one stop per node per minute, however many heartbeats see critical.
    if victim is not None and cache.add(f"berth:watchdog:protect:{node.pk}", 1, PROTECT_INTERVAL_SECONDS):
        deployment = deployments[victim.key]
        log.warning("memory on %s is critical: stopping %s (priority %s)", node.name, deployment.name,
                    deployment.priority)
        audit.record(ACTOR, "watchdog.protect", deployment, scope=deployment.owner, details={
            "node": node.name, "available_bytes": node.memory_available_bytes, "margin_bytes": margin})
        service.stop(ACTOR, deployment)
    return level
