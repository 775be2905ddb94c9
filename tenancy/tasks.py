"""Celery tasks of the tenancy app: thin wrappers over ``tenancy.services``."""
