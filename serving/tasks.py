"""Every Celery task of the serving app, each under the name ``serving.queues`` sends it by. Thin
wrappers: the work is the control side's (on the control queue). A node's work is not a Celery task:
its agent claims it through the node API (``serving.queues.to_node``). Nothing imports this module
but Celery (``app.autodiscover_tasks``)."""

from celery import shared_task
from celery.signals import worker_shutdown

from serving import queues
from serving.catalog import fetch
from serving.control import node_jobs, reconcile as control_loop, serve_model
from serving.deployments import operations
from serving.models import FetchJob


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


@worker_shutdown.connect
def _hand_over_lease(**_):
    control_loop.hand_over()  # a control worker stopping cleanly hands the loop's lease over at once


@shared_task(name=queues.EXPIRE_NODE_LEASES)
def expire_node_leases() -> int:
    """Node jobs whose lease ran out back to the queue, or failed (``serving.control.node_jobs.expire_leases``)."""
    return node_jobs.expire_leases()
