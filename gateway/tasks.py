"""Celery tasks of the gateway app: thin wrappers over ``gateway.services``."""

from celery import shared_task

from gateway import services


@shared_task(name="gateway.retry_usage")
def retry_usage() -> int:
    """Write usage records parked after a database failure (schedule it every minute)."""
    return services.retry_parked_usage()
