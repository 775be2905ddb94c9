"""Celery tasks of the project package itself: the daily backup (berth/settings.py schedules it when
BERTH_BACKUP_DIR is set). Thin wrappers over berth/backup.py; no app is imported."""

from __future__ import annotations

import logging

from celery import shared_task

from berth import backup

log = logging.getLogger(__name__)


@shared_task(name="berth.backup")
def take_backup() -> str:
    path = backup.create()
    log.info("backup written: %s", path)
    return str(path)
