"""The state machine of replicas and deployments, and the one function that moves them.

Every transition writes a DeploymentEvent (with the engine's log tail on failure) and publishes a
live event for the console; a replica that ends (stopped or failed) gives back what it held in the
same transaction. A deployment's state is derived from its replicas' (the most
advanced one wins), so it never drifts from them.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from scheduler import memory
from scheduler.models import Accelerator
from serving import events
from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica
from serving.models.states import PRECEDENCE, TERMINAL
from tenancy.services import contracts

# The transitions of dgxmm's deployer (``shared/reference/dgxmm-deployer.md``), on replicas. Where
# it restarts a stopped or failed deployment in place (stopped/failed → starting/queued), Berth makes
# a fresh replica (planned → …), so the old one's record stays as it ended and a start job that
# arrives after its replica was stopped can never bring that engine up. starting → stopped is not
# here: a stop while the engine launches goes through stopping, so the row never says stopped while
# an engine of it may still run.
ALLOWED = {
    S.PLANNED: {S.QUEUED, S.STARTING, S.STOPPED, S.FAILED},
    S.QUEUED: {S.STARTING, S.STOPPED, S.FAILED},
    S.STARTING: {S.LOADING, S.READY, S.FAILED, S.STOPPING},  # ready: an engine up before it was watched
    S.LOADING: {S.READY, S.FAILED, S.STOPPING},
    S.READY: {S.SLEEPING, S.STOPPING, S.FAILED},
    S.SLEEPING: {S.READY, S.STOPPING, S.FAILED},
    S.STOPPING: {S.STOPPED, S.FAILED},  # failed: its node was lost while it stopped
    S.STOPPED: {S.FAILED},  # a failure found after it stopped (its node lost with it): the reason is kept
    # failed again: a later failure's reason and log tail replace the first. Ready: its node came
    # back and its engine still runs — a replica failed only because its node was lost (no
    # heartbeat) is taken back by the node's agent, its memory and contract share claimed again
    # under the node's lock (``serving.control.adopt.take_back``); the only way back from failed.
    S.FAILED: {S.STOPPED, S.FAILED, S.READY},
    S.UNKNOWN: {S.READY, S.STOPPING, S.FAILED},
}


class IllegalTransition(Exception):
    pass


def move(replica: Replica, to: str, message: str = "", *, log_tail: str = "", **fields) -> bool:
    """Move ``replica`` to ``to`` if it is still where the caller saw it; return False if another
    worker moved it first (a conditional update: the row count is the truth)."""
    origin = replica.state
    if to not in ALLOWED.get(origin, ()):
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
        if to in TERMINAL:  # ended and given back together: nobody sees one without the other
            release(replica)
    _publish(replica, origin, to, message)
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


def accelerators_of(deployment: Deployment) -> list[Accelerator]:
    """The deployment's accelerators in its own order (the first is the one its estimate is for)."""
    if not deployment.gpu_uuids:
        return []
    found = {a.uuid: a for a in Accelerator.objects.filter(uuid__in=deployment.gpu_uuids)}
    return [found[uuid] for uuid in deployment.gpu_uuids if uuid in found]


def holder_of(replica: Replica) -> str:
    """The name a replica's memory reservation and contract holdings are kept under."""
    return f"replica:{replica.public_id}"


def release(replica: Replica) -> None:
    """Give back what the replica held: its memory on the node and its share of the contracts.
    ``move`` does it for every replica that ends; a deployment removed gives back its replicas'."""
    holder = holder_of(replica)
    memory.release_reservation(holder)
    contracts.release(holder)


def _publish(replica: Replica, origin: str, to: str, message: str) -> None:
    """A live event for the console, and a nudge to every gateway to reload its routing table;
    both best effort, after the commit (the routing table's short TTL covers a lost message)."""
    deployment_id, replica_id = str(replica.deployment.public_id), str(replica.public_id)
    transaction.on_commit(events.routing_changed)
    transaction.on_commit(lambda: events.replica_moved(deployment_id, replica_id, origin, to, message))
