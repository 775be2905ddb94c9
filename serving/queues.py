"""Work handed to Celery workers, by task name: the names are the wire contract with the workers,
and sending by name means no verb imports the tasks module that calls it back. ``serving.tasks``
registers a task under each of these names. Work for a node is a row its agent claims through the
node API (``to_node``; what each kind means is ``serving.control.node_work``'s)."""

from __future__ import annotations

import logging
import threading
import uuid

from django.core.cache import cache
from django.db import IntegrityError, transaction

from berth.celery import app
from serving import events
from serving.models import NodeJob

log = logging.getLogger(__name__)

CONTROL = "control"  # the control worker: operations, fetch jobs, reconcile passes

RUN_OPERATION = "serving.run_operation"
RUN_FETCH_JOB = "serving.catalog.run_fetch_job"
RECONCILE = "serving.reconcile"
RECONCILE_SOON = "serving.reconcile_soon"
EXPIRE_NODE_LEASES = "serving.expire_node_leases"

# A change of desired state asks for a pass this soon; asks within it join the same pass.
SOON_S = 0.5
_SOON_KEY = "berth:reconcile:soon"
_SOON_FORGOTTEN_S = 30  # a pass asked for that never ran (no control worker) stops muting later asks

# How urgent each kind of node job is: maintenance (a stop, a sleep, a watch) never waits behind a
# start, nor a start behind bulk work (fetching weights, probes).
PRIORITIES = {"stop": NodeJob.MAINTENANCE, "sleep": NodeJob.MAINTENANCE, "watch": NodeJob.MAINTENANCE,
              "start": NodeJob.LIFECYCLE, "wake": NodeJob.LIFECYCLE, "fetch_weights": NodeJob.BULK,
              "probe": NodeJob.BULK}
# Claims waiting in this process hear of a job queued by it at once; those of other processes find
# it at their next look (``serving.control.node_jobs.POLL_SECONDS``).
node_job_queued = threading.Condition()


def enqueue(node, kind: str, *, key: str, replica=None, payload: dict | None = None, priority: int | None = None,
            available_at=None, max_attempts: int = 3) -> NodeJob:
    """Queue a job of ``kind`` for ``node``; a job with ``key`` already (in any state) is returned as
    it is. ``priority`` defaults to the kind's; ``available_at`` holds it back until then."""
    existing = NodeJob.objects.filter(idempotency_key=key).first()
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            job = NodeJob.objects.create(
                node=node, kind=kind, idempotency_key=key, replica=replica, payload=payload or {},
                priority=PRIORITIES.get(kind, NodeJob.BULK) if priority is None else priority,
                available_at=available_at, max_attempts=max_attempts)
    except IntegrityError:  # queued by another caller since we looked
        existing = NodeJob.objects.filter(idempotency_key=key).first()
        if existing is None:
            raise
        return existing
    transaction.on_commit(lambda: node_job_queued_for(node.pk), robust=True)
    return job


def node_jobs_channel(node_id: int) -> str:
    """Where a job queued for a node is announced, so its agent's waiting claims look at once."""
    return f"berth:node-jobs:{node_id}"


def node_job_queued_for(node_id: int) -> None:
    """A job was queued for the node: claims waiting in this process hear it at once, those of other
    processes over Redis (without Redis, at their next look)."""
    with node_job_queued:
        node_job_queued.notify_all()
    events.publish(node_jobs_channel(node_id), "1")


def to_node(kind: str, replica, payload: dict | None = None):
    """Queue a job of ``kind`` (start, stop, sleep, wake, watch) on ``replica``'s node. Without a
    ``payload``, a second ask while one is open (queued or leased) adds nothing: that one is returned
    (a duplicate that slips past this check is cancelled at its claim, which reads the replica again)."""
    if not payload:
        open_job = NodeJob.objects.filter(replica=replica, kind=kind, state__in=NodeJob.OPEN).first()
        if open_job is not None:
            return open_job
    return enqueue(replica.node, kind, key=f"{kind}:{replica.public_id}:{uuid.uuid4().hex[:16]}", replica=replica,
                   payload=payload)


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
