"""A replica's stop, as the control plane records it: at once, never waiting on the node.

A replica that has not started is cancelled there and then. One whose engine runs moves to
``stopping`` — the gateways route nothing more to it — and its node is asked to stop the engine
(a job the control plane holds back while the requests in flight on it drain). One whose engine is
being launched at that moment (``starting``, no handle yet) moves to ``stopping`` too, and the start
in progress stops its own engine once it reports it launched.
"""

from __future__ import annotations

import dataclasses

from serving import queues
from serving.deployments import states
from serving.models import DeploymentState as S, NodeJob, Replica
from serving.models.states import BEFORE_START, TERMINAL
from serving.runtimes.base import Handle

STOP = "stop"


def begin(replica: Replica) -> None:
    """Record the stop on the replica's row. Each move is conditional on the state just read; when a
    start moved the replica meanwhile (say ``starting`` → ``loading``), it is read again and the stop
    tried again, so a stop is never lost to a start."""
    while True:
        replica = Replica.objects.select_related("deployment", "node").filter(pk=replica.pk).first()
        if replica is None or replica.state in TERMINAL:
            return
        if replica.state in BEFORE_START:
            if states.move(replica, S.STOPPED, "cancelled before it started"):
                return
            continue
        if replica.state == S.STOPPING:
            if replica.handle:  # (a stop asked for twice asks the node once: ``to_node`` adds nothing)
                queues.to_node(STOP, replica)
            return
        launching = replica.state == S.STARTING and not replica.handle
        message = "stopping: the start in progress stops its engine once launched" if launching else "stopping"
        if states.move(replica, S.STOPPING, message):
            if not launching:
                queues.to_node(STOP, replica)  # the node stops the engine the row names, once drained
            return


def stop_engine(replica: Replica, handle: Handle, then: dict) -> NodeJob:
    """Ask the node to stop ``handle``, an engine of ``replica`` that is not (or no longer) the one its
    row stops — a failed one, one found running after its replica ended; ``then`` says what the stop's
    completion records: {"state": "failed" (with the engine's log tail) | "stopped" | "" (an event only),
    "message", "launch_failure"}. A plain stop of a stopping replica is ``to_node("stop", replica)``."""
    return queues.to_node(STOP, replica, {"handle": dataclasses.asdict(handle), "then": then})


def stopping(replica: Replica) -> bool:
    """A job that stops the replica's engine is open (queued or leased)."""
    return NodeJob.objects.filter(replica=replica, kind=STOP, state__in=NodeJob.OPEN).exists()
