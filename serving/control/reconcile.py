"""The control loop's pass (beat runs it every 15 s): replicas on a lost node are failed, which gives
back what they held (their agent cannot report, and cannot be asked to stop them); then the
placement policy's plan is applied (it also unloads on-demand models idle past their timeout).
The agents reconcile what runs on their own node (``serving.node.heartbeat``)."""

from __future__ import annotations

import time

from django.core.cache import cache
from django.db import transaction

from scheduler.models import Node
from serving import queues
from serving.control import placement
from serving.deployments import states
from serving.models import DeploymentState as S, Replica
from serving.models.states import ACTIVE


def run() -> int:
    """One pass; returns how many replicas of lost nodes it failed."""
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


def fail_replicas_of_lost_nodes() -> int:
    """Fail what a lost node was running, node by node under its row lock, the node read again
    first: one whose agent registered meanwhile is back, and its agent keeps its replicas (a
    registration waits for this lock, so an agent never adopts while its replicas are being failed).
    The reason goes on the row too (``exit_reason``): an agent that comes back finds by it the
    replicas it may take back (``serving.node.adopt.take_back``), so its wording is kept."""
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
