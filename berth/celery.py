"""The Celery application shared by the worker, beat, the node agents and the web processes."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "berth.settings")

app = Celery("berth")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
