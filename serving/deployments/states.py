"""The state machine of replicas and deployments, and the one function that moves them.

Every transition writes a DeploymentEvent (with the engine's log tail on failure) and publishes a
live event for the console. A deployment's state is derived from its replicas' (the most
advanced one wins), so it never drifts from them.
"""

from __future__ import annotations

import json
import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica

log = logging.getLogger(__name__)

ALLOWED = {
    S.PLANNED: {S.QUEUED, S.STARTING, S.STOPPED, S.FAILED},
    S.QUEUED: {S.STARTING, S.STOPPED, S.FAILED},
    S.STARTING: {S.LOADING, S.FAILED, S.STOPPING, S.STOPPED},
    S.LOADING: {S.READY, S.FAILED, S.STOPPING},
    S.READY: {S.SLEEPING, S.STOPPING, S.FAILED},
    S.SLEEPING: {S.READY, S.STOPPING, S.FAILED},
    S.STOPPING: {S.STOPPED, S.FAILED},  # failed: its node was lost while it stopped
    # Ended for good: starting a deployment again makes a fresh replica, so a start job that arrives
    # after its replica was stopped can never bring the engine up.
    S.STOPPED: set(),
    S.FAILED: {S.STOPPED},
    S.UNKNOWN: {S.READY, S.STOPPING, S.FAILED},
}
# Which live replica's state speaks for the deployment when they differ, most telling first.
PRECEDENCE = (S.READY, S.LOADING, S.STARTING, S.QUEUED, S.PLANNED, S.SLEEPING, S.UNKNOWN, S.STOPPING)
TERMINAL = (S.STOPPED, S.FAILED)
ACTIVE = (S.QUEUED, S.STARTING, S.LOADING, S.READY, S.SLEEPING, S.UNKNOWN)


class IllegalTransition(Exception):
    pass


def move(replica: Replica, to: str, message: str = "", *, log_tail: str = "", **fields) -> bool:
    """Move ``replica`` to ``to`` if it is still where the caller saw it; return False if another
    worker moved it first (a conditional update: the row count is the truth)."""
    origin = replica.state
    if to not in ALLOWED.get(origin, ()):  # same state again is not a transition either
        raise IllegalTransition(f"{origin} → {to} is not a transition of a replica")
    now = timezone.now()
    stamp = {S.QUEUED: "queued_at", S.LOADING: "started_at", S.READY: "ready_at", S.STOPPED: "stopped_at",
             S.FAILED: "stopped_at"}.get(to)
    if stamp and stamp not in fields:
        fields[stamp] = now
    with transaction.atomic():
        updated = Replica.objects.filter(pk=replica.pk, state=origin).update(state=to, **fields)
        if not updated:
            return False
        replica.state = to
        for name, value in fields.items():
            setattr(replica, name, value)
        deployment = Deployment.objects.select_for_update().get(pk=replica.deployment_id)
        DeploymentEvent.objects.create(deployment=deployment, replica=replica, from_state=origin, to_state=to,
                                       message=message[:2000], log_tail=log_tail[-20000:])
        summarise(deployment, message)
    publish(replica, origin, to, message)
    return True


def summarise(deployment: Deployment, detail: str = "") -> None:
    """The deployment's state: its live replicas' (the most telling one), else its latest replica's."""
    live = set(deployment.replica_set.exclude(state__in=TERMINAL).values_list("state", flat=True))
    if live:
        state = next(s for s in PRECEDENCE if s in live)
    else:
        latest = deployment.replica_set.order_by("-created_at", "-pk").values_list("state", flat=True).first()
        state = latest or S.PLANNED
    if state != deployment.state or detail:
        deployment.state = state
        deployment.state_detail = detail[:2000]
        deployment.save(update_fields=["state", "state_detail", "updated_at"])


def publish(replica: Replica, origin: str, to: str, message: str) -> None:
    """A live event for the console, and a nudge to every gateway to reload its routing table;
    both best effort, after the commit (the routing table's short TTL covers a lost message)."""
    from serving.routing import publish_changed

    transaction.on_commit(publish_changed)
    if not settings.REDIS_URL:
        return
    payload = json.dumps({"deployment": str(replica.deployment.public_id), "replica": str(replica.public_id),
                          "from": origin, "to": to, "message": message, "at": timezone.now().isoformat()})

    def send():
        try:
            import redis

            redis.Redis.from_url(settings.REDIS_URL).publish("berth:deployments", payload)
        except Exception as exc:  # the console misses one live update; the row is already there
            log.warning("could not publish a deployment event: %s", exc)

    transaction.on_commit(send)
