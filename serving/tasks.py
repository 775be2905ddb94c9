"""Every Celery task of the serving app, each under the name ``serving.queues`` sends it by. Thin
wrappers: the work is in the node's modules (on a node's queue, ``node.<name>``) and the control
side's (on the control queue). Nothing imports this module but Celery (``app.autodiscover_tasks``)."""

import threading

from celery import shared_task
from celery.signals import worker_init, worker_ready, worker_shutdown

from serving import queues
from serving.catalog import fetch
from serving.control import reconcile as control_loop, serve_model
from serving.deployments import operations
from serving.models import FetchJob, Replica
from serving.node import heartbeat, lifecycle
from serving.node.runtime import node_name

_stop = threading.Event()


@shared_task(name=queues.START_REPLICA, acks_late=False)
def start_replica(replica_id: str) -> None:
    lifecycle.start_replica(replica_id)


@shared_task(name=queues.STOP_REPLICA, acks_late=False)
def stop_replica(replica_id: str) -> None:
    lifecycle.stop_replica(replica_id)


@shared_task(name=queues.SLEEP_REPLICA, acks_late=False)
def sleep_replica(replica_id: str) -> None:
    lifecycle.sleep_replica(replica_id)


@shared_task(name=queues.WAKE_REPLICA, acks_late=False)
def wake_replica(replica_id: str) -> None:
    lifecycle.wake_replica(replica_id)


@shared_task(name=queues.WATCH_REPLICA, acks_late=False)
def watch_replica(replica_id: str) -> None:
    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is not None:
        lifecycle.watch_startup(replica)
        lifecycle.admit_next(replica.node_id)


@shared_task(name=queues.RUN_OPERATION)
def run_operation(operation_id: str) -> str:
    return operations.run(operation_id).state


@shared_task(name=queues.RUN_FETCH_JOB)
def run_fetch_job(job_id: str) -> str:
    job = FetchJob.objects.filter(public_id=job_id).first()
    if job is None:
        return "gone"
    if job.kind == FetchJob.Kind.SERVE:
        return serve_model.run(job).status
    return fetch.run(job).status


@shared_task(name=queues.RECONCILE)
def reconcile() -> int:
    """The control side of reconciliation (``serving.control.reconcile.run``)."""
    return control_loop.run()


@shared_task(name=queues.RECONCILE_SOON)
def reconcile_soon() -> int:
    """A pass asked for by a change of desired state (``serving.control.reconcile.run_soon``)."""
    return control_loop.run_soon()


@worker_init.connect
def _adopt(**_):
    if node_name():
        heartbeat.start_up()


@worker_ready.connect
def _start_heartbeat(**_):
    if node_name():  # only the node agents beat; the control worker does not
        threading.Thread(target=heartbeat.heartbeat_forever, args=(_stop,), name="berth-heartbeat",
                         daemon=True).start()


@worker_shutdown.connect
def _stop_heartbeat(**_):
    _stop.set()


@worker_shutdown.connect
def _hand_over_lease(**_):
    if not node_name():  # a control worker stopping cleanly hands the loop's lease over at once
        control_loop.hand_over()
