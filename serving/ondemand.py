"""On-demand models: loaded by their first request, unloaded after their idle timeout.

A catalog entry whose scaling minimum is 0 has no replica until a request asks for it. The
gateway calls ``serving.routing.request_load`` for a model with no ready replica; that calls
``load`` here, which starts the model's stopped deployment or places a new one. The gateway tells
us when models were last used (``note_used``, batched with its usage records); the reconcile loop
stops those idle past their timeout. Idle time that is not known (after a restart) is not idle:
the clock starts when we first see the model running.
"""

from __future__ import annotations

import logging
import time

from django.core.cache import cache
from django.db import transaction

from berth.errors import BerthError
from scheduler.models import Node
from serving.catalog.entries import deploy_request
from serving.catalog.models import ModelEntry
from serving.deployments import service, states
from serving.models import Deployment, DeploymentState as S
from tenancy.audit import Actor

log = logging.getLogger(__name__)
ACTOR = Actor(system="on-demand")
DEFAULT_IDLE_SECONDS = 15 * 60


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
            return service.start(ACTOR, stopped)
        return _place(entry)


def _place(entry: ModelEntry) -> Deployment:
    refusals = []
    for node in Node.objects.filter(state=Node.State.READY).order_by("name"):
        try:
            return service.deploy(ACTOR, deploy_request(entry, node))
        except BerthError as error:  # does not fit here: try the next node
            refusals.append(f"{node.name}: {error.message}")
    raise NotLoadable(f"{entry.name} fits on no node now ({'; '.join(refusals) or 'no ready node'}).",
                      details={"refusals": refusals})


def _used_key(name: str) -> str:
    return f"berth:ondemand:last-used:{name}"


def note_used(last_used: dict[str, float]) -> None:
    """Record when models were last asked for (epoch seconds); the gateway calls this in batches."""
    if last_used:
        cache.set_many({_used_key(name): at for name, at in last_used.items()}, None)


def unload_idle(now: float | None = None) -> list[str]:
    """Stop the ready deployments of on-demand models idle past their timeout; return their names."""
    now = now or time.time()
    entries = {e.name: e for e in ModelEntry.objects.filter(scaling_min=0)}
    running = list(Deployment.objects.filter(name__in=entries, state=S.READY))
    if not running:
        return []
    seen = cache.get_many([_used_key(d.name) for d in running])
    stopped = []
    for deployment in running:
        last = seen.get(_used_key(deployment.name))
        if last is None:  # not known is not idle: start counting now
            cache.set(_used_key(deployment.name), now, None)
            continue
        timeout = entries[deployment.name].idle_timeout_seconds or DEFAULT_IDLE_SECONDS
        if now - last >= timeout:
            log.info("unloading %s: idle for %.0f s (timeout %s s)", deployment.name, now - last, timeout)
            service.stop(ACTOR, deployment)
            stopped.append(deployment.name)
    return stopped
