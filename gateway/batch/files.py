"""The Batch API's files: bytes under ``settings.BATCH_DIR`` (one file per ``BatchFile`` row, named by
its id), never in the database; and the one reading of a batch input that both its validation at
upload and the worker that runs it use (``requests``), so what was accepted is what runs.

A batch input is JSONL, one request a line, in OpenAI's shape::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "…", …}}

Blank lines are skipped; a request's index counts requests, from 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator

import orjson
from django.conf import settings
from django.utils import timezone

from gateway.errors import InvalidBatchFile, TooLarge
from gateway.models import BatchFile

# What a batch may run: OpenAI's batch endpoints that Berth's gateway serves, and its rerank.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank")
CUSTOM_ID_MAX = 200  # BatchLine.custom_id
CHUNK = 1 << 20


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def path_of(file: BatchFile) -> Path:
    return Path(settings.BATCH_DIR) / file.public_id


def retention_end():
    return timezone.now() + timedelta(days=settings.BATCH_RETENTION_DAYS)


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    line: int  # in the file, from 1 (what an error names)
    custom_id: str
    url: str
    model: str
    offset: int  # where its body's line starts in the file, and how long it is
    length: int


def requests(path: Path) -> Iterator[Request]:
    """Every request of a batch input in order, checked; raises ``InvalidBatchFile`` naming the first
    line that is not a request Berth can run."""
    index = 0
    seen: set[str] = set()
    with open(path, "rb") as handle:
        offset = 0
        for number, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            request = _parse(raw, number, index, start, seen)
            seen.add(request.custom_id)
            index += 1
            yield request


def _parse(raw: bytes, number: int, index: int, offset: int, seen: set[str]) -> Request:
    def refuse(reason: str, param: str | None = None):
        details = {"line": number, "reason": reason}
        if param:
            details["param"] = param
        raise InvalidBatchFile(f"Line {number} of the batch input: {reason}", details=details)

    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        refuse("not valid JSON.")
    if not isinstance(item, dict):
        refuse("a request must be a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        refuse("`custom_id` is required: a string naming this request in the output.", "custom_id")
    if len(custom_id) > CUSTOM_ID_MAX:
        refuse(f"`custom_id` is longer than {CUSTOM_ID_MAX} characters.", "custom_id")
    if custom_id in seen:
        refuse(f"`custom_id` {custom_id[:60]!r} is used twice; each request needs its own.", "custom_id")
    if item.get("method") != "POST":
        refuse("`method` must be \"POST\".", "method")
    url = item.get("url")
    if url not in ENDPOINTS:
        refuse(f"`url` must be one of {', '.join(ENDPOINTS)}.", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        refuse("`body` must be a JSON object: the request as it would be sent to `url`.", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        refuse("`body.model` is required: the name of a model this key may use.", "body.model")
    if body.get("stream") is True:
        refuse("a batch's requests cannot stream: leave `body.stream` out.", "body.stream")
    return Request(index=index, line=number, custom_id=custom_id, url=url, model=model, offset=offset,
                   length=len(raw))


def body_of(handle, request: Request) -> bytes:
    """The JSON body of ``request``, read from an open input file (re-encoded compactly)."""
    handle.seek(request.offset)
    return orjson.dumps(orjson.loads(handle.read(request.length))["body"])


def store_upload(chunks: Iterable[bytes], filename: str, client_pk: int) -> BatchFile:
    """A batch input from its uploaded chunks: written aside while counted and hashed, checked line by
    line, then kept under its id. Nothing is kept when it is refused."""
    directory = Path(settings.BATCH_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    limit = settings.BATCH_MAX_FILE_BYTES
    digest, size = hashlib.sha256(), 0
    handle = tempfile.NamedTemporaryFile(dir=directory, prefix=".upload-", delete=False)
    temp = Path(handle.name)
    try:
        with handle:
            for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TooLarge(f"The file is larger than {limit} bytes (BERTH_BATCH_MAX_FILE_BYTES).",
                                   details={"limit": limit})
                digest.update(chunk)
                handle.write(chunk)
        lines, endpoints, models = 0, set(), set()
        for request in requests(temp):
            lines += 1
            if lines > settings.BATCH_MAX_LINES:
                raise InvalidBatchFile(
                    f"The batch input has more than {settings.BATCH_MAX_LINES} requests (BERTH_BATCH_MAX_LINES).",
                    details={"line": request.line, "reason": "too many requests", "limit": settings.BATCH_MAX_LINES})
            endpoints.add(request.url)
            models.add(request.model)
        if not lines:
            raise InvalidBatchFile("The batch input holds no request.", details={"reason": "empty"})
        file = BatchFile(public_id=new_id("file-"), purpose=BatchFile.Purpose.BATCH, filename=filename[:255],
                         bytes=size, sha256=digest.hexdigest(), lines=lines, endpoints=sorted(endpoints),
                         model_names=sorted(models), client_id=client_pk, expires_at=retention_end())
        os.replace(temp, path_of(file))
        try:
            file.save()
        except BaseException:
            path_of(file).unlink(missing_ok=True)
            raise
        return file
    finally:
        temp.unlink(missing_ok=True)


def write_output(public_id: str, filename: str, lines: Iterable[bytes], client_pk: int) -> BatchFile | None:
    """A batch's output (or errors) file from its JSONL lines; None when there are none."""
    directory = Path(settings.BATCH_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    file = BatchFile(public_id=public_id, purpose=BatchFile.Purpose.BATCH_OUTPUT, filename=filename, bytes=0,
                     sha256="", client_id=client_pk, expires_at=retention_end())
    digest, size = hashlib.sha256(), 0
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".output-", delete=False) as handle:
        for line in lines:
            chunk = line + b"\n"
            digest.update(chunk)
            size += len(chunk)
            handle.write(chunk)
    if not size:
        Path(handle.name).unlink(missing_ok=True)
        return None
    os.replace(handle.name, path_of(file))
    file.bytes, file.sha256 = size, digest.hexdigest()
    file.save()
    return file


def delete(file: BatchFile) -> None:
    """The row, then its bytes (a file whose row is gone is unreachable; the reverse would not be)."""
    file.delete()
    path_of(file).unlink(missing_ok=True)


def content(file: BatchFile) -> Iterator[bytes]:
    with open(path_of(file), "rb") as handle:
        while chunk := handle.read(CHUNK):
            yield chunk
