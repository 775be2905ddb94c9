"""Celery tasks of the scheduler: thin wrappers over ``scheduler.services`` (none yet)."""
