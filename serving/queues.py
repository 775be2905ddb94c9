"""Work handed to Celery workers, by task name: the names are the wire contract with the workers
(a node's agent may run another release), and sending by name means no verb imports the tasks
module that calls it back. ``serving.tasks`` registers a task under each of these names."""

from __future__ import annotations

import logging

from django.core.cache import cache
from django.db import transaction

from berth.celery import app

log = logging.getLogger(__name__)

CONTROL = "control"  # the control worker: operations, fetch jobs, reconcile passes

START_REPLICA = "serving.tasks.start_replica"
STOP_REPLICA = "serving.tasks.stop_replica"
SLEEP_REPLICA = "serving.tasks.sleep_replica"
WAKE_REPLICA = "serving.tasks.wake_replica"
WATCH_REPLICA = "serving.tasks.watch_replica"
RUN_OPERATION = "serving.run_operation"
RUN_FETCH_JOB = "serving.catalog.run_fetch_job"
RECONCILE = "serving.reconcile"
RECONCILE_SOON = "serving.reconcile_soon"

# A change of desired state asks for a pass this soon; asks within it join the same pass.
SOON_S = 0.5
_SOON_KEY = "berth:reconcile:soon"
_SOON_FORGOTTEN_S = 30  # a pass asked for that never ran (no control worker) stops muting later asks

REPLICA_TASKS = {"start": START_REPLICA, "stop": STOP_REPLICA, "sleep": SLEEP_REPLICA, "wake": WAKE_REPLICA,
                 "watch": WATCH_REPLICA}


def node_queue(node_name: str) -> str:
    """The queue the agent of ``node_name`` takes its work from."""
    return f"node.{node_name}"


def to_node(operation: str, replica) -> None:
    """Hand an engine operation on ``replica`` (start, stop, sleep, wake, watch) to its node's agent."""
    app.send_task(REPLICA_TASKS[operation], args=[str(replica.public_id)], queue=node_queue(replica.node.name))


def to_control(task: str, *args) -> None:
    """Hand ``task`` (one of the names above) to the control worker."""
    app.send_task(task, args=list(args), queue=CONTROL)


def reconcile_soon() -> None:
    """Ask for a reconcile pass within a second, once the caller's transaction commits (a deploy, a
    stop, a catalog model's placement, pin, minimum or fallbacks changed). The first ask of a burst
    sends one pass half a second later; the others find it pending and add nothing. Best effort: the
    beat's periodic pass catches an ask lost to a broker or cache outage."""
    transaction.on_commit(_send_reconcile_soon, robust=True)


def _send_reconcile_soon() -> None:
    try:
        if cache.add(_SOON_KEY, 1, timeout=_SOON_FORGOTTEN_S):
            app.send_task(RECONCILE_SOON, queue=CONTROL, countdown=SOON_S)
    except Exception as error:  # noqa: BLE001 - the periodic pass covers it
        log.warning("could not ask for a reconcile pass now (%s); the periodic one will do", error)


def reconcile_soon_started() -> None:
    """The pass asked for has begun reading: asks from now on need a pass of their own."""
    cache.delete(_SOON_KEY)
