"""Celery tasks of the serving app: thin wrappers over ``serving.agent`` (run on a node's queue)."""

import threading

from celery import shared_task
from celery.signals import worker_init, worker_ready, worker_shutdown

from serving import agent

_stop = threading.Event()


@shared_task(acks_late=False)
def start_replica(replica_id: str) -> None:
    agent.start_replica(replica_id)


@shared_task(acks_late=False)
def stop_replica(replica_id: str) -> None:
    agent.stop_replica(replica_id)


@shared_task(acks_late=False)
def sleep_replica(replica_id: str) -> None:
    agent.sleep_replica(replica_id)


@shared_task(acks_late=False)
def wake_replica(replica_id: str) -> None:
    agent.wake_replica(replica_id)


@shared_task(acks_late=False)
def watch_replica(replica_id: str) -> None:
    from serving.models import Replica

    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is not None:
        agent.watch_startup(replica)
        agent.admit_next(replica.node_id)


@shared_task(name="serving.run_operation")
def run_operation(operation_id: str) -> str:
    from serving.deployments import operations

    return operations.run(operation_id).state


@shared_task(name="serving.reconcile")
def reconcile() -> int:
    """The control side of reconciliation: replicas on a lost node are failed and what they held is
    given back (their agent cannot report, and cannot be asked to stop them); the placement policy's
    plan is applied (it also unloads on-demand models idle past their timeout)."""
    from serving.deployments import placement
    from serving.deployments.reconcile import fail_replicas_of_lost_nodes

    failed = fail_replicas_of_lost_nodes()
    placement.reconcile()  # Scheduler II's plan for the catalog's models, applied
    return failed


@worker_init.connect
def _adopt(**_):
    if agent.node_name():
        agent.start_up()


@worker_ready.connect
def _start_heartbeat(**_):
    if agent.node_name():  # only the node agents beat; the control worker does not
        threading.Thread(target=agent.heartbeat_forever, args=(_stop,), name="berth-heartbeat", daemon=True).start()


@worker_shutdown.connect
def _stop_heartbeat(**_):
    _stop.set()
