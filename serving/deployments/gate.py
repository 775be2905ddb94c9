"""The start-up gate: at most ``SERVING_STARTUP_SLOTS`` engines start or load at once per node.

An engine sizing its cache while another starts can fail, so starts take turns. A replica that
finds every slot taken keeps its reservation and port and waits as ``queued``, first come first
served. A replica launched in the room of preempted ones (``waits_for``) also waits, queued,
until they have stopped (or, put to sleep to make room, are asleep): their reservations were handed
over at once, their memory is free only once their engines exit or sleep. Stops and sleeps never pass
through the gate.

A wake passes through it like a start (on unified memory, an engine waking while another profiles
its memory breaks that start). A sleeping replica whose wake was asked for is in the same line,
placed by ``wake_requested_at`` among the queued starts' ``queued_at``; while it wakes it holds a
slot (``waking_since``). It stays ``sleeping`` throughout: it serves nothing until it is awake.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from scheduler.models import Node
from serving.deployments import states
from serving.models import DeploymentState as S, Replica
from serving.models.states import BEFORE_START, STARTING_UP, TERMINAL

# A wake in progress ends within the wake timeout (its call to the engine is bounded by what is
# left of it); one still holding its slot this long after that was cut off (its agent restarted).
STALE_WAKE_GRACE_SECONDS = 60


def busy(node_id: int) -> int:
    """How many of the node's start-up slots are taken: engines starting or loading, and wakes."""
    stale = timezone.now() - timedelta(seconds=settings.SERVING_WAKE_TIMEOUT_SECONDS + STALE_WAKE_GRACE_SECONDS)
    return Replica.objects.filter(Q(state__in=STARTING_UP) | Q(state=S.SLEEPING, waking_since__isnull=False,
                                                                wake_requested_at__gte=stale),
                                  node_id=node_id).count()


def waiting_wakes(node_id: int) -> QuerySet:
    """The node's sleeping replicas whose wake was asked for and waits for a slot."""
    return Replica.objects.filter(node_id=node_id, state=S.SLEEPING, wake_requested_at__isnull=False,
                                  waking_since__isnull=True)


def _ahead(replica: Replica, since) -> tuple[QuerySet, QuerySet]:
    """The queued starts and the waiting wakes in line before ``replica`` (all of them when it has
    no place yet: ``since`` None)."""
    starts = Replica.objects.filter(node_id=replica.node_id, state=S.QUEUED).exclude(pk=replica.pk)
    wakes = waiting_wakes(replica.node_id).exclude(pk=replica.pk)
    if since is not None:
        starts, wakes = starts.filter(queued_at__lt=since), wakes.filter(wake_requested_at__lt=since)
    return starts, wakes


def claim(replica: Replica) -> bool:
    """Take a start slot for ``replica`` (moving it to ``starting``), or queue it. Under the node's
    row lock, so two agents' workers cannot both take the last slot."""
    with transaction.atomic():
        Node.objects.select_for_update().get(pk=replica.node_id)
        replica.refresh_from_db()
        if replica.state not in BEFORE_START:
            # Stopped or failed (a stop cancelled it before its start job arrived), or started by
            # another job: a replica that ended never starts again (a start makes a new one).
            return False
        taken = busy(replica.node_id)
        starts, wakes = _ahead(replica, replica.queued_at if replica.state == S.QUEUED else None)
        # A replica preempted by sleep has handed its device memory over once it is asleep.
        handing_over = Replica.objects.filter(public_id__in=replica.waits_for) \
            .exclude(state__in=TERMINAL + (S.SLEEPING,)).count() if replica.waits_for else 0
        if taken < settings.SERVING_STARTUP_SLOTS and not starts.exists() and not wakes.exists() \
                and not handing_over:
            return states.move(replica, S.STARTING, "start-up slot taken")
        if handing_over and replica.state != S.QUEUED:
            states.move(replica, S.QUEUED, f"waiting for {handing_over} replica(s) stopped to make room for it")
        elif replica.state != S.QUEUED:
            position = starts.count() + wakes.count() + 1
            states.move(replica, S.QUEUED, f"waiting for a start-up slot on {replica.node.name} "
                                           f"(position {position}; {taken} starting or waking)")
        return False


def ask_wake(replica: Replica) -> None:
    """Put ``replica``'s wake in line, now; a wake already in line keeps its place."""
    now = timezone.now()
    if Replica.objects.filter(pk=replica.pk, state=S.SLEEPING, wake_requested_at__isnull=True) \
            .update(wake_requested_at=now):
        replica.wake_requested_at = now
    else:
        replica.refresh_from_db(fields=["state", "wake_requested_at", "waking_since"])


def claim_wake(replica: Replica) -> bool:
    """Take a start-up slot for ``replica``'s wake (marking it ``waking_since``) when one is free
    and nothing is ahead of it in line; else it keeps its place. False too when its wake is no
    longer wanted (stopped, given up) or another dispatch of it took the slot: the caller reads
    the row to tell which. Under the node's row lock, like ``claim``."""
    with transaction.atomic():
        Node.objects.select_for_update().get(pk=replica.node_id)
        replica.refresh_from_db()
        if replica.state != S.SLEEPING or replica.wake_requested_at is None or replica.waking_since is not None:
            return False
        starts, wakes = _ahead(replica, replica.wake_requested_at)
        if busy(replica.node_id) >= settings.SERVING_STARTUP_SLOTS or starts.exists() or wakes.exists():
            return False
        now = timezone.now()
        taken = Replica.objects.filter(pk=replica.pk, state=S.SLEEPING, wake_requested_at=replica.wake_requested_at,
                                       waking_since__isnull=True).update(waking_since=now)
        if taken:
            replica.waking_since = now
        return bool(taken)


def wake_deadline(replica: Replica):
    """When a wake asked for at ``wake_requested_at`` gives up (``SERVING_WAKE_TIMEOUT_SECONDS``)."""
    return replica.wake_requested_at + timedelta(seconds=settings.SERVING_WAKE_TIMEOUT_SECONDS)


def expired_wakes(node_id: int) -> QuerySet:
    """Wakes past their deadline that still wait for a slot, and wakes that held one past it by
    more than the grace (their agent was cut off): both give up."""
    now = timezone.now()
    waited = now - timedelta(seconds=settings.SERVING_WAKE_TIMEOUT_SECONDS)
    stale = waited - timedelta(seconds=STALE_WAKE_GRACE_SECONDS)
    return Replica.objects.select_related("deployment", "node").filter(
        Q(waking_since__isnull=True, wake_requested_at__lt=waited) | Q(waking_since__isnull=False,
                                                                       wake_requested_at__lt=stale),
        node_id=node_id, state=S.SLEEPING)


def position(replica: Replica) -> int | None:
    """1 for the next in line; None when neither a queued start nor a waiting wake."""
    if replica.state == S.QUEUED and replica.queued_at is not None:
        since = replica.queued_at
    elif replica.state == S.SLEEPING and replica.wake_requested_at is not None and replica.waking_since is None:
        since = replica.wake_requested_at
    else:
        return None
    starts, wakes = _ahead(replica, since)
    return starts.count() + wakes.count() + 1


def wake_position(replicas) -> int | None:
    """The best place in line among a deployment's waiting wakes (None: none waits, say one wakes)."""
    places = [p for p in (position(r) for r in replicas) if p is not None]
    return min(places) if places else None


def next_in_line(node_id: int) -> Replica | None:
    """The next to get a free slot: the earliest queued start or waiting wake (a sleeping replica)."""
    start = (Replica.objects.select_related("deployment", "node").filter(node_id=node_id, state=S.QUEUED)
             .order_by("queued_at", "pk").first())
    wake = waiting_wakes(node_id).select_related("deployment", "node").order_by("wake_requested_at", "pk").first()
    if start is None or wake is None:
        return start or wake
    return wake if wake.wake_requested_at < start.queued_at else start
