"""The Batch API's periodic sweep (beat, every few seconds): a batch no live worker holds is queued
again (its worker died, or its message was lost with the broker), and what is past its retention
goes — ended batches with their lines and files, files no running batch reads, the leases of ended
batches."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db.models import Q
from django.utils import timezone

from berth import lease
from berth.models import Lease
from gateway.batch import files, runner, service
from gateway.models import Batch, BatchFile

REQUEUE_AFTER_S = 30  # a batch queued again is not queued again before this, while no worker takes it


def sweep() -> dict:
    now = timezone.now()
    active = list(Batch.objects.filter(status__in=service.ACTIVE).values_list("public_id", "input_file_id"))
    queued = []
    for public_id, _ in active:
        held = lease.read(runner.LEASE + public_id)
        if (held is None or held.expired) and cache.add(f"berth:batch-queued:{public_id}", 1, REQUEUE_AFTER_S):
            service.enqueue(public_id)
            queued.append(public_id)
    cutoff = now - timedelta(days=settings.BATCH_RETENTION_DAYS)
    ended = Q(completed_at__lt=cutoff) | Q(failed_at__lt=cutoff) | Q(expired_at__lt=cutoff) | Q(cancelled_at__lt=cutoff)
    removed = 0
    for batch in Batch.objects.filter(status__in=service.ENDED).filter(ended).select_related("output_file",
                                                                                             "error_file"):
        for file in (batch.output_file, batch.error_file):
            if file is not None:
                files.delete(file)
        batch.delete()
        removed += 1
    reading = {file_pk for _, file_pk in active if file_pk}
    old_files = list(BatchFile.objects.filter(expires_at__lt=now).exclude(pk__in=reading))
    for file in old_files:
        files.delete(file)
    live = [runner.LEASE + public_id for public_id, _ in active]
    Lease.objects.filter(name__startswith=runner.LEASE, expires_at__lt=now).exclude(name__in=live).delete()
    return {"queued": queued, "batches_removed": removed, "files_removed": len(old_files)}
