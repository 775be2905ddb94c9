"""The Celery broker as the rest of the project sees it: prepared at start, probed by /readyz."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from berth.celery import app


def prepare() -> None:
    """The file-system transport needs its folders before the first message."""
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
        for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
            Path(options[key]).mkdir(parents=True, exist_ok=True)


def check(timeout: float = 2.0) -> None:
    """Raise if the broker cannot be reached within ``timeout`` seconds."""
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1, timeout=timeout)
        if settings.CELERY_BROKER_URL.startswith(("redis", "rediss", "unix")):
            connection.default_channel.client.ping()
