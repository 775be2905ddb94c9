"""The control loop's pass (beat runs it every 15 s): replicas on a lost node are failed, which gives
back what they held (their agent cannot report, and cannot be asked to stop them); then the
placement policy's plan is applied (it also unloads on-demand models idle past their timeout).
What runs on each node is reconciled with its heartbeats (``serving.control.node_reports``).

One process runs the periodic pass: the holder of the control loop's lease (``berth.lease``), which
it renews each pass and which expires after three missed passes (``berth.health.MISSED_PASSES``), so
two beat processes, or two control workers, never both run the loop; a contender skips the pass and
says so in the log, and takes the lease over once it has expired. The pass a change asks for
(``run_soon``) and on-demand loads run wherever they were asked, one at a time under placement's pass
lock: they answer one change, and making them wait for the holder would only delay it."""

from __future__ import annotations

import logging
import time

from django.core.cache import cache
from django.db import transaction

from berth import health, lease
from scheduler.models import Node
from serving import queues
from serving.control import placement
from serving.deployments import states
from serving.models import DeploymentState as S, Replica
from serving.models.states import ACTIVE

log = logging.getLogger(__name__)


def run() -> int:
    """One periodic pass, by the lease's holder only; returns how many replicas of lost nodes it failed
    (0 when it skipped the pass: another process holds the lease)."""
    if not lead():
        return 0
    failed = fail_replicas_of_lost_nodes()
    placement.reconcile()
    cache.set("berth:control:last-pass", time.time(), None)  # berth.health: the loop is alive
    return failed


def run_soon() -> int:
    """The pass a change of desired state asked for (``queues.reconcile_soon``). When another pass is
    under way it waits for it; should that one have read the fleet before the change, it asks again."""
    queues.reconcile_soon_started()
    failed = fail_replicas_of_lost_nodes()
    if placement.reconcile(wait_s=30).get("skipped"):  # a pass takes seconds; 30 s waits out a slow one
        queues.reconcile_soon()
    cache.set("berth:control:last-pass", time.time(), None)  # berth.health: the loop is alive
    return failed


def lease_seconds() -> float:
    """How long the lease lasts unrenewed: three passes' interval (the loop is stale after as many)."""
    return health.MISSED_PASSES * (health.pass_interval() or 15.0)


def lead(holder: str | None = None) -> bool:
    """Take or renew the control loop's lease for ``holder`` (this process by default); False, and a
    log line naming the holder, when another process holds it."""
    holder = holder or lease.identity()
    before = lease.read(lease.CONTROL_LOOP)
    held, current = lease.claim(lease.CONTROL_LOOP, holder, lease_seconds())
    if not held:
        log.info("control loop pass skipped: its lease is held by %s (renewed %.0f s ago, expires in %.0f s)",
                 current.holder, current.renewed_age_s, (current.expires_at - current.now).total_seconds())
        return False
    if before is None:
        log.info("control loop lease taken by %s", holder)
    elif before.holder != holder:
        log.warning("control loop lease taken over by %s from %s, whose lease expired %.0f s ago "
                    "(it last renewed it %.0f s ago)", holder, before.holder,
                    (current.now - before.expires_at).total_seconds(),
                    (current.now - before.renewed_at).total_seconds())
    elif before.expired:
        log.info("control loop lease taken again by %s (it had expired)", holder)
    return True


def hand_over() -> None:
    """Give the lease up if this process holds it (its worker stops cleanly): another takes it at
    its next pass instead of three passes later. Best effort: an expiry covers a failure here."""
    try:
        if lease.release(lease.CONTROL_LOOP, lease.identity()):
            log.info("control loop lease given up by %s", lease.identity())
    except Exception as exc:  # noqa: BLE001 - the database may be what is going away
        log.warning("could not give up the control loop lease: %s", exc)


def fail_replicas_of_lost_nodes() -> int:
    """Fail what a lost node was running, node by node under its row lock, the node read again
    first: one whose agent registered meanwhile is back, and its agent keeps its replicas (a
    registration waits for this lock, so an agent never adopts while its replicas are being failed).
    The reason goes on the row too (``exit_reason``): an agent that comes back finds by it the
    replicas it may take back (``serving.control.adopt.take_back``), so its wording is kept."""
    failed = 0
    lost = Node.objects.filter(state=Node.State.LOST, replicas__state__in=ACTIVE + (S.STOPPING,)).distinct()
    for node_id in lost.values_list("pk", flat=True):
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=node_id)
            if node.state != Node.State.LOST:
                continue
            for replica in Replica.objects.select_related("deployment", "node").filter(
                    node=node, state__in=ACTIVE + (S.STOPPING,)):
                message = f"node {node.name} is lost (no heartbeat): its engines cannot be reached or stopped from here"
                if states.move(replica, S.FAILED, message, exit_reason=message[:300]):
                    failed += 1
    return failed
