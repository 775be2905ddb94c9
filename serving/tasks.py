"""Celery tasks of the serving app: thin wrappers over ``serving.services``."""
