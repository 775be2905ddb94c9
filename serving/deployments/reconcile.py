"""Reconciliation run by the control worker (the agents reconcile what runs on their own node)."""

from __future__ import annotations

from scheduler.models import Node
from serving.deployments import states
from serving.deployments.service import release
from serving.models import DeploymentState as S, Replica


def fail_replicas_of_lost_nodes() -> int:
    failed = 0
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node__state=Node.State.LOST, state__in=states.ACTIVE + (S.STOPPING,)):
        target = S.FAILED
        if states.move(replica, target, f"node {replica.node.name} is lost (no heartbeat): "
                                        "its engines cannot be reached or stopped from here"):
            release(replica)
            failed += 1
    return failed
