"""The start-up gate: at most ``SERVING_STARTUP_SLOTS`` engines start or load at once per node.

An engine sizing its cache while another starts can fail, so starts take turns. A replica that
finds every slot taken keeps its reservation and port and waits as ``queued``, first come first
served. A replica launched in the room of preempted ones (``waits_for``) also waits, queued,
until they have stopped: their reservations were handed over at once, their memory is free only
once their engines exit. Stops and sleeps never pass through the gate.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from scheduler.models import Node
from serving.deployments import states
from serving.models import DeploymentState as S, Replica

BUSY = (S.STARTING, S.LOADING)
STOPPED = (S.STOPPED, S.FAILED)


def claim(replica: Replica) -> bool:
    """Take a start slot for ``replica`` (moving it to ``starting``), or queue it. Under the node's
    row lock, so two agents' workers cannot both take the last slot."""
    with transaction.atomic():
        Node.objects.select_for_update().get(pk=replica.node_id)
        replica.refresh_from_db()
        if replica.state not in (S.PLANNED, S.QUEUED):
            # Stopped or failed (a stop cancelled it before its start job arrived), or started by
            # another job: a replica that ended never starts again (a start makes a new one).
            return False
        busy = Replica.objects.filter(node_id=replica.node_id, state__in=BUSY).count()
        ahead = Replica.objects.filter(node_id=replica.node_id, state=S.QUEUED).exclude(pk=replica.pk)
        if replica.state == S.QUEUED:
            ahead = ahead.filter(queued_at__lt=replica.queued_at)
        handing_over = Replica.objects.filter(public_id__in=replica.waits_for).exclude(state__in=STOPPED).count() \
            if replica.waits_for else 0
        if busy < settings.SERVING_STARTUP_SLOTS and not ahead.exists() and not handing_over:
            return states.move(replica, S.STARTING, "start-up slot taken")
        if handing_over and replica.state != S.QUEUED:
            states.move(replica, S.QUEUED, f"waiting for {handing_over} replica(s) stopped to make room for it")
        elif replica.state != S.QUEUED:
            position = ahead.count() + 1
            states.move(replica, S.QUEUED, f"waiting for a start-up slot on {replica.node.name} "
                                           f"(position {position}; {busy} starting)")
        return False


def position(replica: Replica) -> int | None:
    """1 for the next in line; None when not queued."""
    if replica.state != S.QUEUED or replica.queued_at is None:
        return None
    return Replica.objects.filter(node_id=replica.node_id, state=S.QUEUED,
                                  queued_at__lt=replica.queued_at).count() + 1


def next_in_line(node_id: int) -> Replica | None:
    return (Replica.objects.select_related("deployment", "node").filter(node_id=node_id, state=S.QUEUED)
            .order_by("queued_at", "pk").first())
