"""The Batch API's operations for a key's client (``gateway.batch.views`` under /v1/, the console under
/gateway/batches/) and the shapes OpenAI's clients read (``file_object``, ``batch_object``).

A client sees its own files and batches only: another's answer ``file_not_found`` / ``batch_not_found``,
as if they did not exist.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from berth.celery import app
from gateway.batch import files
from gateway.errors import (BadRequest, BatchEnded, BatchNotFound, FileInUse, FileNotFound, ModelNotAllowed, shown)
from gateway.models import Batch, BatchFile

log = logging.getLogger(__name__)

ACTIVE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING)
ENDED = (Batch.Status.COMPLETED, Batch.Status.FAILED, Batch.Status.EXPIRED, Batch.Status.CANCELLED)
_WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_HOURS = 168
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
LIST_LIMIT = 100
RUN_BATCH = "gateway.run_batch"


def _ts(moment) -> int | None:
    return int(moment.timestamp()) if moment else None


def file_object(file: BatchFile) -> dict:
    return {"id": file.public_id, "object": "file", "bytes": file.bytes, "created_at": _ts(file.created_at),
            "expires_at": _ts(file.expires_at), "filename": file.filename, "purpose": file.purpose,
            "status": "processed", "status_details": None}


def eta_seconds(batch: Batch, now=None) -> int | None:
    """How long until it ends at the pace it has gone so far; None until a line has ended."""
    done = batch.completed + batch.failed
    if batch.status != Batch.Status.IN_PROGRESS or not done or not batch.in_progress_at:
        return None
    elapsed = ((now or timezone.now()) - batch.in_progress_at).total_seconds()
    return max(0, round(elapsed / done * (batch.total - done)))


def batch_object(batch: Batch) -> dict:
    def file_id(file_pk, file):
        return file.public_id if file_pk else None

    return {
        "id": batch.public_id, "object": "batch", "endpoint": batch.endpoint, "errors": batch.errors,
        "input_file_id": file_id(batch.input_file_id, batch.input_file),
        "completion_window": batch.completion_window, "status": batch.status,
        "output_file_id": file_id(batch.output_file_id, batch.output_file),
        "error_file_id": file_id(batch.error_file_id, batch.error_file),
        "created_at": _ts(batch.created_at), "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at), "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at), "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at), "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata or None,
        "eta_seconds": eta_seconds(batch),  # Berth's: at the pace so far, while in progress
    }


def _batches():
    return Batch.objects.select_related("input_file", "output_file", "error_file")


# -- files ----------------------------------------------------------------------------------------

def upload(client_pk: int, purpose: str, upload) -> BatchFile:
    if purpose != BatchFile.Purpose.BATCH:
        raise BadRequest(f"`purpose` must be \"batch\" (the only files Berth keeps); got {shown(str(purpose))!r}.",
                         param="purpose")
    if upload is None:
        raise BadRequest("`file` is required: the batch's requests as JSONL.", param="file")
    return files.store_upload(upload.chunks(files.CHUNK), upload.name or "batch.jsonl", client_pk)


def file_of(client_pk: int, public_id: str) -> BatchFile:
    file = BatchFile.objects.filter(client_id=client_pk, public_id=public_id).first()
    if file is None:
        raise FileNotFound(f"No file {shown(public_id)!r}.", details={"file": shown(public_id)})
    return file


def files_of(client_pk: int, purpose: str | None, limit: int, after: str | None) -> tuple[list[BatchFile], bool]:
    query = BatchFile.objects.filter(client_id=client_pk)
    if purpose:
        query = query.filter(purpose=purpose)
    return _page(query, limit, after)


def delete_file(client_pk: int, public_id: str) -> None:
    file = file_of(client_pk, public_id)
    if Batch.objects.filter(input_file=file, status__in=ACTIVE).exists():
        raise FileInUse(f"The file {file.public_id} is the input of a batch that has not ended; cancel it first.",
                        details={"file": file.public_id})
    files.delete(file)


# -- batches --------------------------------------------------------------------------------------

def create(principal, payload) -> Batch:
    """A batch of the key's client from its JSON ``payload`` (OpenAI's fields), queued to run."""
    if not isinstance(payload, dict):
        raise BadRequest("The request body must be a JSON object.")
    endpoint = payload.get("endpoint")
    if endpoint not in files.ENDPOINTS:
        raise BadRequest(f"`endpoint` must be one of {', '.join(files.ENDPOINTS)}.", param="endpoint")
    window = payload.get("completion_window", "24h")
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None or int(match.group(1)) > MAX_WINDOW_HOURS:
        raise BadRequest(f"`completion_window` must be hours, \"1h\" to \"{MAX_WINDOW_HOURS}h\" (OpenAI's is \"24h\").",
                         param="completion_window")
    metadata = _metadata(payload.get("metadata"))
    input_id = payload.get("input_file_id")
    if not isinstance(input_id, str) or not input_id:
        raise BadRequest("`input_file_id` is required: the id of a file uploaded with purpose \"batch\".",
                         param="input_file_id")
    file = file_of(principal.client_pk, input_id)
    if file.purpose != BatchFile.Purpose.BATCH:
        raise BadRequest(f"The file {file.public_id} is a batch's output, not an input.", param="input_file_id")
    other = [url for url in file.endpoints if url != endpoint]
    if other:
        raise BadRequest(f"Every request of the batch must be for {endpoint}; the file also names {', '.join(other)}.",
                         param="endpoint", details={"endpoints": file.endpoints})
    refused = [name for name in file.model_names if not principal.allows(name)]
    if refused:
        raise ModelNotAllowed(f"This key may not use the model {shown(refused[0])!r}, which the batch names.",
                              details={"models": [shown(name) for name in refused[:10]]})
    batch = Batch.objects.create(
        public_id=files.new_id("batch_"), endpoint=endpoint, completion_window=window, metadata=metadata,
        input_file=file, credential_id=principal.credential_pk, client_id=principal.client_pk,
        scope_path=principal.project_path, total=file.lines or 0,
        expires_at=timezone.now() + timedelta(hours=int(match.group(1))))
    transaction.on_commit(lambda: enqueue(batch.public_id))
    return batch


def _metadata(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= METADATA_KEY_CHARS
            and len(v) <= METADATA_VALUE_CHARS for k, v in value.items()):
        raise BadRequest(f"`metadata` is at most {METADATA_KEYS} string pairs (keys up to {METADATA_KEY_CHARS} "
                         f"characters, values up to {METADATA_VALUE_CHARS}).", param="metadata")
    return value


def enqueue(public_id: str) -> None:
    """Ask a worker to run it now; when the broker cannot be reached the sweep starts it later. Sent by
    task name (``gateway.tasks`` registers it), so this module does not import the tasks calling it."""
    try:
        app.send_task(RUN_BATCH, args=[public_id], queue=settings.BATCH_QUEUE)
    except Exception as exc:  # noqa: BLE001 - the periodic sweep finds every batch without a runner
        log.warning("batch %s: could not queue its run now (%s); the sweep starts it", public_id, exc)


def batch_of(client_pk: int, public_id: str) -> Batch:
    batch = _batches().filter(client_id=client_pk, public_id=public_id).first()
    if batch is None:
        raise BatchNotFound(f"No batch {shown(public_id)!r}.", details={"batch": shown(public_id)})
    return batch


def batches_of(client_pk: int, limit: int, after: str | None) -> tuple[list[Batch], bool]:
    return _page(_batches().filter(client_id=client_pk), limit, after)


def cancel(batch: Batch) -> Batch:
    """Stop sending its lines: those in flight finish, the rest are written to its error file."""
    with transaction.atomic():
        batch = _batches().select_for_update(of=("self",)).get(pk=batch.pk)
        if batch.status in ENDED:
            raise BatchEnded(f"The batch {batch.public_id} has already ended ({batch.status}).",
                             details={"batch": batch.public_id, "status": batch.status})
        if batch.status != Batch.Status.CANCELLING:
            batch.status, batch.cancelling_at = Batch.Status.CANCELLING, timezone.now()
            batch.save(update_fields=["status", "cancelling_at"])
    enqueue(batch.public_id)  # a batch no worker holds is finished by the one this starts
    return batch


def _page(query, limit: int, after: str | None):
    """Newest first, ``limit`` at most, after the one named (OpenAI's cursor)."""
    if after:
        anchor = query.filter(public_id=after).values_list("created_at", "id").first()
        if anchor is None:
            raise BadRequest(f"`after` names nothing listed here: {shown(after)!r}.", param="after")
        query = query.filter(created_at__lte=anchor[0]).exclude(created_at=anchor[0], id__gte=anchor[1])
    rows = list(query.order_by("-created_at", "-id")[:limit + 1])
    return rows[:limit], len(rows) > limit
