"""The control loop's pass (beat runs it every 15 s): replicas on a lost node are failed, which gives
back what they held (their agent cannot report, and cannot be asked to stop them); then the
placement policy's plan is applied (it also unloads on-demand models idle past their timeout).
The agents reconcile what runs on their own node (``serving.node.heartbeat``)."""

from __future__ import annotations

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
    return failed


def run_soon() -> int:
    """The pass a change of desired state asked for (``queues.reconcile_soon``). When another pass is
    under way it waits for it; should that one have read the fleet before the change, it asks again."""
    queues.reconcile_soon_started()
    failed = fail_replicas_of_lost_nodes()
    if placement.reconcile(wait_s=30).get("skipped"):  # a pass takes seconds; 30 s waits out a slow one
        queues.reconcile_soon()
    return failed


def fail_replicas_of_lost_nodes() -> int:
    failed = 0
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node__state=Node.State.LOST, state__in=ACTIVE + (S.STOPPING,)):
        if states.move(replica, S.FAILED, f"node {replica.node.name} is lost (no heartbeat): "
                                          "its engines cannot be reached or stopped from here"):
            failed += 1
    return failed
