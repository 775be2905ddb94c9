"""Celery tasks of the scheduler: thin wrappers over ``scheduler.services``."""

from celery import shared_task

from scheduler import services


@shared_task(name="scheduler.mark_lost_nodes")
def mark_lost_nodes() -> list[str]:
    """Run every minute or so (a beat entry named ``scheduler.mark_lost_nodes``)."""
    return services.mark_lost_nodes()
