"""On-demand models: loaded by their first request, unloaded after their idle timeout.

A catalog entry whose scaling minimum is 0 has no replica until a request asks for it. The gateway
calls ``request_load`` for a model with no ready replica; that calls ``load``, which starts the
model's stopped deployment or places a new one. The gateway tells us when models were last used
(``serving.load.note_used``, batched with its usage records); the placement policy stops those idle
past their timeout (``load.last_used`` is what its snapshot reads). Idle time that is not known
(after a restart) is not idle: the clock starts when we first see the model running. A new replica
is placed by the placement policy, as every catalog model's is; when nothing fits as the fleet
stands it may make room by stopping idle on-demand replicas of lower (or, for a load, equal) classes.

A model nothing will bring up by request is refused at once, saying why: a parked one (the recovery
ladder gave up on it) with its park reason and last error; an always-on one (scaling minimum 1 or
more, placed by the reconcile loop, not by requests) with the placement policy's latest reason —
unless that loop is bringing it back (its replica failed or ended after it was placed): then a
request waits for it as for a load, and is told when to retry.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from berth.errors import BerthError, Unavailable
from scheduler import recovery_service
from scheduler.conf import policy_settings
from scheduler.models import PlacementDecision, RecoveryState
from scheduler.policy import recovery
from serving.catalog import room
from serving.control import placement
from serving.deployments import service
from serving.models import Deployment, DeploymentState as S, ModelEntry, Replica
from serving.models.states import LOADABLE, SERVING, STARTING_UP, TERMINAL
from tenancy.audit import Actor

log = logging.getLogger(__name__)
ACTOR = Actor(system="on-demand")
ASK_POLICY_EVERY_S = 5
WAKE_EXPECTED_S = 10.0  # a vLLM wake moves its weights back to the GPU: seconds, where a load takes minutes


class NotLoadable(Unavailable):
    """The model will not come up on its own: the gateway answers at once with 503 and no ``Retry-After``."""

    code = "model_not_loaded"


class NoIdleRoom(NotLoadable):
    """A model only batch requests wait for fits nowhere without preempting: a batch's line waits and
    asks again (``gateway.batch.lines.RETRY_LATER``), an interactive request would not be refused."""

    code = "no_idle_capacity"


@dataclasses.dataclass(frozen=True)
class LoadTicket:
    """A load is under way (or was asked for); ``expected_seconds`` is how long until it should be up.
    ``coming_back``: why an always-on model with no replica comes up again without a request's
    help (the reconcile loop relaunches it); "" for a load a request asked for."""

    model: str
    expected_seconds: float
    coming_back: str = ""


def entry_for(name: str) -> ModelEntry | None:
    """The catalog entry answering to ``name`` (its name or one of its aliases)."""
    entry = ModelEntry.objects.filter(name=name).first()
    if entry is None:
        entry = next((e for e in ModelEntry.objects.filter(aliases__icontains=name) if name in e.aliases), None)
    return entry


def load(name: str, batch: bool = False) -> Deployment:
    """Make ``name`` come up: start its stopped deployment or place a new one. Quick (the agent does
    the loading) and harmless when many waiting requests call it at once. ``batch``: asked by a
    request at the batch priority, which is placed only where room is free (``_place``)."""
    entry = entry_for(name)
    if entry is None:
        raise NotLoadable(f"{name} is not in the catalog: nothing loads it on request.",
                          details={"reason": "not in the catalog"})
    parked = recovery_service.parked_now(entry.name, entry.fingerprint)
    if parked is not None:  # the ladder gave up on it: no pass would place it, so none is asked for
        reason = f"{parked['detail']}; it is placed again once an operator retries it or its definition changes"
        raise NotLoadable(f"{entry.name} is {reason}.", details={
            "reason": reason, "parked": True, "failure": parked["kind"], "consecutive": parked["consecutive"],
            "last_error": parked["last_error"]})
    if entry.scaling_min != 0:
        reason, said = _why_not_placed(entry)
        raise NotLoadable(f"{entry.name} is always on (placed by the reconcile loop, not by requests) and has no "
                          f"ready replica: {reason}.", details={"reason": reason, "policy": said})
    with transaction.atomic():
        # One loader at a time per model: the entry's row is the lock.
        ModelEntry.objects.select_for_update().filter(pk=entry.pk).first()
        active = Deployment.objects.filter(name=entry.name, state__in=SERVING).first()
        if active is not None:
            return active
        stopped = Deployment.objects.filter(name=entry.name, state__in=TERMINAL) \
            .order_by("-created_at").first()
        if stopped is not None:
            try:
                return service.start(ACTOR, stopped)
            except BerthError as error:  # no room where it ran last: place it afresh
                log.info("%s cannot start where it ran (%s); placing it afresh", entry.name, error.message)
        return _place(entry, batch)


def _place(entry: ModelEntry, batch: bool) -> Deployment:
    """Placed by the placement policy, like every catalog model: its order (weights held, best fit)
    and, when nothing fits as the fleet stands, its preemption (idle on-demand replicas first) —
    unless every request waiting for it is at the batch priority (``batch`` for this one): then it
    takes only free room, and a refusal is ``NoIdleRoom``, which a batch waits out.
    Asked at most once per model every few seconds: a burst of requests for a model that cannot be
    placed gets the policy's last answer, not a pass each (a batch ask's answer apart, since it
    is not one an interactive request would get)."""
    if room.desired_model(entry) is None:
        raise NotLoadable(f"{entry.name} has no verified, servable file with an estimate: nothing can place it.")
    asked = _asked_key(entry.name) + (":batch" if batch else "")
    why = cache.get(asked)
    if why is None:
        outcome = placement.reconcile(waiting={entry.name: 1}, batch_waiting={entry.name: 1} if batch else None,
                                      wait_s=ASK_POLICY_EVERY_S)
        placed = Deployment.objects.filter(name=entry.name, state__in=SERVING).first()
        if placed is not None:
            return placed
        why = outcome.get("unschedulable", {}).get(entry.name) or ""
        if not outcome.get("skipped"):
            cache.set(asked, why, ASK_POLICY_EVERY_S)
    refusal = NoIdleRoom if batch else NotLoadable
    raise refusal(f"{entry.name} fits on no node now; the placement policy: {why or 'busy, ask again'}.",
                  details={"policy": why})


WHY_NOT_PLACED = (PlacementDecision.Verdict.UNSCHEDULABLE, PlacementDecision.Verdict.BACKOFF,
                  PlacementDecision.Verdict.HELD, PlacementDecision.Verdict.PARKED)


def _why_not_placed(entry: ModelEntry) -> tuple[str, str]:
    """Why an always-on model has no replica, and what the placement policy last said about it (its
    latest applied decision; "" when it has said nothing), without asking it again: a request is
    answered at once, and the reconcile loop asks it every pass anyway."""
    if room.desired_model(entry) is None:
        return "it has no verified, servable file with an estimate: nothing can place it", ""
    latest = (PlacementDecision.objects.filter(kind=PlacementDecision.Kind.PLAN, model=entry.name)
              .order_by("-created_at", "-id").values("verdict", "detail").first())
    if latest is not None and latest["verdict"] in WHY_NOT_PLACED and latest["detail"]:
        return f"the placement policy: {latest['detail']}", latest["detail"]
    return "not placed yet; the reconcile loop places it once it fits", ""


# The policy's verdicts after which an always-on model with no replica comes back by itself:
# placed (its replica has since failed or ended: the next pass relaunches it), backing off before
# the relaunch, held back while it gave room. Not unschedulable (fits nowhere as the fleet stands)
# nor parked: those are refused with the policy's reason.
COMING_BACK = (PlacementDecision.Verdict.PLACED, PlacementDecision.Verdict.BACKOFF, PlacementDecision.Verdict.HELD)


def _pass_every_s() -> float:
    """How often beat runs the reconcile pass that relaunches always-on models (its schedule)."""
    return next((float(entry["schedule"]) for entry in settings.CELERY_BEAT_SCHEDULE.values()
                 if entry.get("task") == "serving.reconcile"), 15.0)


def _coming_back(name: str) -> tuple[float, str] | None:
    """For an always-on model the reconcile loop is bringing back: the seconds until its relaunch
    starts at the latest (the next pass, the backoff or the hold left) and why; None for anything
    else (not in the catalog, on demand, parked, nothing servable, never placed, fits nowhere)."""
    entry = entry_for(name)
    if entry is None or entry.scaling_min == 0 or recovery_service.parked_now(entry.name, entry.fingerprint):
        return None
    latest = (PlacementDecision.objects.filter(kind=PlacementDecision.Kind.PLAN, model=entry.name)
              .order_by("-created_at", "-id").values_list("verdict", flat=True).first())
    if latest not in COMING_BACK or room.desired_model(entry) is None:
        return None
    now = time.time()
    start_in, why = _pass_every_s(), "its replica ended; the reconcile loop relaunches it"
    failure = RecoveryState.objects.filter(model=entry.name, consecutive__gt=0, last_failure_at__isnull=False) \
        .values("kind", "consecutive", "last_failure_at").first()
    if failure is not None:
        not_before = failure["last_failure_at"].timestamp() + recovery.backoff(failure["consecutive"],
                                                                                policy_settings())
        if not_before > now:
            start_in = max(start_in, not_before - now)
            why = f"its replica failed ({failure['kind']}); relaunched after the recovery ladder's backoff"
    hold = next((h for h in cache.get(placement.HOLDS_KEY) or () if h.get("model") == entry.name), None)
    if hold is not None and hold["until"] > now:
        start_in = max(start_in, hold["until"] - now)
        why = "held back after giving room to another model; relaunched when the hold ends"
    return start_in, why


def _asked_key(name: str) -> str:
    return f"berth:ondemand:policy-said:{name}"


def _expected_load_seconds(deployments: list[Deployment]) -> float:
    """From how long this model's replicas took to become ready before, else the configured default,
    less what the current load has already spent."""
    default = float(getattr(settings, "GATEWAY_EXPECTED_LOAD_SECONDS", 60))
    past = list(Replica.objects.filter(deployment__in=deployments, ready_at__isnull=False, started_at__isnull=False)
                .order_by("-ready_at").values_list("started_at", "ready_at")[:10])
    typical = statistics.median([(ready - started).total_seconds() for started, ready in past]) if past else default
    started = (Replica.objects.filter(deployment__in=deployments, state__in=STARTING_UP,
                                      started_at__isnull=False)
               .order_by("started_at").values_list("started_at", flat=True).first())
    elapsed = (timezone.now() - started).total_seconds() if started else 0.0
    return max(1.0, typical - elapsed)


def _wake(deployment: Deployment, deployments: list[Deployment]) -> LoadTicket:
    """A request for a model that only sleeps wakes it, through the start-up gate, once: the requests
    after it find the wake asked for and wait with it."""
    asked = deployment.replica_set.filter(state=S.SLEEPING, wake_requested_at__isnull=False).exists()
    if not asked:
        try:
            service.wake(ACTOR, deployment, wait_seconds=0)
        except BerthError as error:  # the reconcile pass places it elsewhere if it cannot wake where it sleeps
            log.info("%s could not be woken for a request: %s", deployment.name, error.message)
    return LoadTicket(model=deployment.name, expected_seconds=WAKE_EXPECTED_S)


def request_load(model_name: str, batch: bool = False) -> LoadTicket:
    """Ask for ``model_name`` to be made ready; return at once with the expected wait. ``batch``: the
    request asking is at the batch priority (placed only where room is free: ``_place``).

    An always-on model that the reconcile loop is bringing back (``_coming_back``: its replica
    failed or ended and the next pass relaunches it, after the recovery ladder's backoff or a hold)
    gets a ticket too, ``coming_back`` saying why: the gateway waits for it like a load.

    Raises ``NotLoadable`` (503, code ``model_not_loaded``) when nothing can bring it up, its
    ``details`` saying why (``reason``; for a parked model also ``parked``, ``failure`` and
    ``last_error``; for an always-on one, ``policy``: what the placement policy last said).
    """
    deployments = [d for d in Deployment.objects.filter(name=model_name)]
    loadable = [d for d in deployments if d.state in LOADABLE]
    if loadable and all(d.state == S.SLEEPING for d in loadable):
        return _wake(loadable[0], deployments)
    if not loadable:
        back = _coming_back(model_name)
        if back is not None:
            start_in, why = back
            return LoadTicket(model=model_name, expected_seconds=start_in + _expected_load_seconds(deployments),
                              coming_back=why)
        try:  # an on-demand model: its first request loads it (starting or placing a deployment)
            loadable = [load(model_name, batch)]
        except NotLoadable as refusal:
            message, details = refusal.message, dict(refusal.details or {})
            failed = [d for d in deployments if d.state == S.FAILED]
            if failed and failed[0].state_detail and entry_for(model_name) is None:
                message = f"no deployment can serve it (last failure: {failed[0].state_detail[:200]})"
                details["reason"] = message
            details = {**details, "model": model_name, "reason": details.get("reason") or message}
            outlook = "waits for free room" if isinstance(refusal, NoIdleRoom) else "will not be"
            raise type(refusal)(f"{model_name} is not loaded and {outlook}: {message}", details=details) from None
    return LoadTicket(model=model_name, expected_seconds=_expected_load_seconds(loadable))
