"""Celery tasks of the gateway app: thin wrappers over ``gateway.services``."""
