"""OpenAI's Files and Batches routes (``/v1/files``, ``/v1/batches``), served by Django: an upload is
multipart and none of this is on the hot path. A key (``Authorization: Bearer`` or ``x-api-key``) of a
client that may use the inference API; its client's files and batches only. Errors in OpenAI's shape
with Berth's stable codes, as the rest of /v1/.
"""

from __future__ import annotations

import functools
import logging

import orjson
from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from berth.errors import BerthError
from gateway.auth import load_principal
from gateway.batch import files, service
from gateway.errors import (BadRequest, DatabaseUnavailable, InferenceNotAllowed, MethodNotAllowed, MissingKey,
                            TooLarge)
from gateway.models import BatchFile
from tenancy.services.clients import credential_from_header

log = logging.getLogger(__name__)


def _json(status: int, data) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


def _error(error: BerthError) -> HttpResponse:
    from gateway.app import error_body

    response = HttpResponse(error_body(error), status=error.status, content_type="application/json")
    for name, value in getattr(error, "headers", None) or ():
        response[name.decode()] = value.decode()
    return response


def _principal(request):
    header = request.headers.get("Authorization")
    if header:
        plaintext = credential_from_header(header)
    elif (request.headers.get("x-api-key") or "").strip():
        plaintext = request.headers["x-api-key"].strip()
    else:
        raise MissingKey("No API key: send it as `Authorization: Bearer brk_…` or `x-api-key: brk_…`.")
    principal, _ = load_principal(plaintext)
    if not principal.may_infer:
        raise InferenceNotAllowed("This key's client may not use the inference API.")
    return principal


def api(methods: tuple[str, ...]):
    """A /v1/ view: its methods, the caller's principal, and every refusal as a coded error."""
    def wrap(view):
        @csrf_exempt  # a key, never a cookie, says who calls
        @functools.wraps(view)
        def handle(request, *args, **kwargs):
            try:
                if request.method not in methods:
                    raise MethodNotAllowed(f"{request.path} takes {' or '.join(methods)}.")
                return view(request, _principal(request), *args, **kwargs)
            except BerthError as error:
                return _error(error)
            except (OperationalError, InterfaceError):
                log.warning("%s %s: the database cannot be reached", request.method, request.path)
                return _error(DatabaseUnavailable("The database cannot be reached; retry shortly."))
        return handle
    return wrap


def _limit(request) -> int:
    raw = request.GET.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= service.LIST_LIMIT:
        raise BadRequest(f"`limit` must be a whole number from 1 to {service.LIST_LIMIT}.", param="limit")
    return limit


def _listing(rows, has_more: bool, shape) -> HttpResponse:
    data = [shape(row) for row in rows]
    return _json(200, {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                       "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@api(("GET", "POST"))
def files_view(request, principal):
    if request.method == "POST":
        length = request.META.get("CONTENT_LENGTH") or ""
        limit = settings.BATCH_MAX_FILE_BYTES + 64 * 1024  # the file, and the form around it
        if length.isdigit() and int(length) > limit:
            raise TooLarge(f"The file is larger than {settings.BATCH_MAX_FILE_BYTES} bytes (BERTH_BATCH_MAX_FILE_BYTES).",
                           details={"limit": settings.BATCH_MAX_FILE_BYTES})
        if not request.content_type.startswith("multipart/form-data"):
            raise BadRequest("Upload the file as multipart/form-data with the fields `file` and `purpose`.")
        file = service.upload(principal.client_pk, request.POST.get("purpose", ""), request.FILES.get("file"))
        return _json(200, service.file_object(file))
    purpose = request.GET.get("purpose") or None
    if purpose is not None and purpose not in BatchFile.Purpose.values:
        raise BadRequest(f"`purpose` is one of {', '.join(BatchFile.Purpose.values)}.", param="purpose")
    rows, more = service.files_of(principal.client_pk, purpose, _limit(request), request.GET.get("after") or None)
    return _listing(rows, more, service.file_object)


@api(("GET", "DELETE"))
def file_view(request, principal, file_id: str):
    if request.method == "DELETE":
        service.delete_file(principal.client_pk, file_id)
        return _json(200, {"id": file_id, "object": "file", "deleted": True})
    return _json(200, service.file_object(service.file_of(principal.client_pk, file_id)))


@api(("GET",))
def file_content_view(request, principal, file_id: str):
    file = service.file_of(principal.client_pk, file_id)
    response = StreamingHttpResponse(files.content(file), content_type="application/octet-stream")
    response["Content-Length"] = str(file.bytes)
    response["Content-Disposition"] = f'attachment; filename="{file.public_id}.jsonl"'
    return response


@api(("GET", "POST"))
def batches_view(request, principal):
    if request.method == "POST":
        try:
            payload = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            raise BadRequest("The request body is not valid JSON.") from None
        with transaction.atomic():
            batch = service.create(principal, payload)
        return _json(200, service.batch_object(batch))
    rows, more = service.batches_of(principal.client_pk, _limit(request), request.GET.get("after") or None)
    return _listing(rows, more, service.batch_object)


@api(("GET",))
def batch_view(request, principal, batch_id: str):
    return _json(200, service.batch_object(service.batch_of(principal.client_pk, batch_id)))


@api(("POST",))
def batch_cancel_view(request, principal, batch_id: str):
    batch = service.cancel(service.batch_of(principal.client_pk, batch_id))
    return _json(200, service.batch_object(service.batch_of(principal.client_pk, batch.public_id)))
