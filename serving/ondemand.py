"""On-demand models: loaded by their first request, unloaded after their idle timeout.

A catalog entry whose scaling minimum is 0 has no replica until a request asks for it. The
gateway calls ``serving.routing.request_load`` for a model with no ready replica; that calls
``load`` here, which starts the model's stopped deployment or places a new one. The gateway tells
us when models were last used (``note_used``, batched with its usage records); the placement
policy stops those idle past their timeout (``last_used`` is what its snapshot reads). Idle time
that is not known (after a restart) is not idle: the clock starts when we first see the model
running. A new replica is placed by the placement policy, as every catalog model's is; when
nothing fits as the fleet stands it may make room by stopping idle on-demand replicas of lower
(or, for a load, equal) classes.
"""

from __future__ import annotations

import logging
import time

from django.core.cache import cache
from django.db import transaction

from berth.errors import BerthError
from serving.catalog.models import ModelEntry
from serving.deployments import service, states
from serving.models import Deployment, DeploymentState as S
from tenancy.audit import Actor

log = logging.getLogger(__name__)
ACTOR = Actor(system="on-demand")
DEFAULT_IDLE_SECONDS = 15 * 60
ASK_POLICY_EVERY_S = 5


class NotLoadable(BerthError):
    status = 503
    code = "model_not_loaded"


def entry_for(name: str) -> ModelEntry | None:
    """The catalog entry answering to ``name`` (its name or one of its aliases)."""
    entry = ModelEntry.objects.filter(name=name).first()
    if entry is None:
        entry = next((e for e in ModelEntry.objects.filter(aliases__icontains=name) if name in e.aliases), None)
    return entry


def load(name: str) -> Deployment:
    """Make ``name`` come up: start its stopped deployment or place a new one. Quick (the agent does
    the loading) and harmless when many waiting requests call it at once."""
    entry = entry_for(name)
    if entry is None or entry.scaling_min != 0:
        raise NotLoadable(f"{name} is not an on-demand model: nothing loads it on request.")
    with transaction.atomic():
        # One loader at a time per model: the entry's row is the lock.
        ModelEntry.objects.select_for_update().filter(pk=entry.pk).first()
        active = Deployment.objects.filter(name=entry.name, state__in=states.ACTIVE + (S.PLANNED,)).first()
        if active is not None:
            return active
        stopped = Deployment.objects.filter(name=entry.name, state__in=(S.STOPPED, S.FAILED)) \
            .order_by("-created_at").first()
        if stopped is not None:
            try:
                return service.start(ACTOR, stopped)
            except BerthError as error:  # no room where it ran last: place it afresh
                log.info("%s cannot start where it ran (%s); placing it afresh", entry.name, error.message)
        return _place(entry)


def _place(entry: ModelEntry) -> Deployment:
    """Placed by the placement policy, like every catalog model: its order (weights held, best fit)
    and, when nothing fits as the fleet stands, its preemption (idle on-demand replicas first).
    Asked at most once per model every few seconds: a burst of requests for a model that cannot be
    placed gets the policy's last answer, not a pass each."""
    from serving.catalog import room
    from serving.deployments import placement

    if room.desired_model(entry) is None:
        raise NotLoadable(f"{entry.name} has no verified, servable file with an estimate: nothing can place it.")
    asked = _asked_key(entry.name)
    why = cache.get(asked)
    if why is None:
        outcome = placement.reconcile(waiting={entry.name: 1}, wait_s=ASK_POLICY_EVERY_S)
        placed = Deployment.objects.filter(name=entry.name, state__in=states.ACTIVE + (S.PLANNED,)).first()
        if placed is not None:
            return placed
        why = outcome.get("unschedulable", {}).get(entry.name) or ""
        if not outcome.get("skipped"):
            cache.set(asked, why, ASK_POLICY_EVERY_S)
    raise NotLoadable(f"{entry.name} fits on no node now; the placement policy: {why or 'busy, ask again'}.",
                      details={"policy": why})


def _asked_key(name: str) -> str:
    return f"berth:ondemand:policy-said:{name}"


def _used_key(name: str) -> str:
    return f"berth:ondemand:last-used:{name}"


def note_used(last_used: dict[str, float]) -> None:
    """Record when models were last asked for (epoch seconds); the gateway calls this in batches."""
    if last_used:
        cache.set_many({_used_key(name): at for name, at in last_used.items()}, None)


def last_used(names, running, now: float | None = None) -> dict[str, float]:
    """When each of ``names`` was last used (epoch seconds), where known. A model in ``running``
    whose last use is not known (the gateway has not served it since a restart) starts its idle
    clock now: not known is not idle."""
    now = now or time.time()
    names = sorted(set(names))
    seen = cache.get_many([_used_key(name) for name in names])
    found = {name: float(seen[_used_key(name)]) for name in names if _used_key(name) in seen}
    fresh = {name: now for name in set(running) - set(found)}
    if fresh:
        cache.set_many({_used_key(name): at for name, at in fresh.items()}, None)
    return {**found, **fresh}
