"""Celery tasks of the gateway app: thin wrappers over ``gateway.services``."""

from celery import shared_task

from gateway import services


@shared_task(name="gateway.retry_usage")
def retry_usage() -> int:
    """Write usage records parked after a database failure (schedule it every minute)."""
    return services.retry_parked_usage()


@shared_task(name="gateway.run_batch")
def run_batch(public_id: str) -> str:
    """Run a batch of the Batch API to its end (``gateway.batch.runner``)."""
    from gateway.batch import runner

    return runner.run(public_id)


@shared_task(name="gateway.sweep_batches")
def sweep_batches() -> dict:
    """Batches without a live worker queued again; what is past retention removed (every few seconds)."""
    from gateway.batch import sweep

    return sweep.sweep()
