__version__ = "0.1.0"

# Importing the Celery app here makes every process that loads Django (web, manage.py) send
# tasks through Berth's configured broker rather than Celery's default one.
from berth.celery import app as celery_app

__all__ = ["celery_app"]
