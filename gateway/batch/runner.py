"""Running a batch (the Celery task ``gateway.run_batch``): its lines go through the gateway's own /v1/
route, so each meets the admission every request meets — the key's scopes, limits and budgets, the
model loaded on demand, and the engine's slots at the **batch** priority, where any interactive
request waiting goes first (``gateway.slots``). A batch thus uses only what interactive traffic
leaves, and is charged like any request.

One worker runs a batch at a time: it holds the lease ``batch:<id>`` (``berth.lease``) and renews it
while it runs; when a worker dies, the periodic sweep (``gateway.batch.sweep``) finds the lease lapsed
and queues the batch again. Nothing is sent twice: the gateway claims a line before an engine hears
it and keeps its answer (``gateway.batch.lines``); a new worker sends only lines still pending, and a
line a gateway claimed but never answered (that gateway died with it) is reported ``interrupted``.

Refusals that may pass later (rate limits, a model loading, every slot busy) keep a line pending and
it is sent again after ``Retry-After``; a refusal of the key (revoked, expired) ends every line left.
The output and error files are written when no line is left (or the batch is cancelled or its window
ends: the lines not sent are written to the error file as ``batch_cancelled`` / ``batch_expired``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from datetime import timedelta

import httpx
import orjson
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from berth import lease
from gateway.batch import files, lines
from gateway.errors import InvalidBatchFile
from gateway.models import Batch, BatchLine

log = logging.getLogger(__name__)
S = Batch.Status
LEASE = "batch:"
COUNT_EVERY_S = 1.0
MAX_BACKOFF_S = 30.0
# What a line never sent is told when its batch stops: (error code, message).
CANCELLED_LINE = ("batch_cancelled", "The batch was cancelled before this request was sent.")
EXPIRED_LINE = ("batch_expired", "The batch's completion window ended before this request was sent.")


def run(public_id: str) -> str:
    """Run the batch to its end unless another worker holds it; returns how it went (for logs and tests)."""
    holder = f"{lease.identity()}:{secrets.token_hex(4)}"
    held, _ = lease.claim(LEASE + public_id, holder, settings.BATCH_LEASE_SECONDS)
    if not held:
        return "held elsewhere"
    try:
        return Runner(public_id, holder).run()
    except Batch.DoesNotExist:
        return "gone"  # deleted (its retention ended, its tenant removed) while its run was queued
    finally:
        lease.release(LEASE + public_id, holder)


def interrupted_after() -> timedelta:
    """A claimed line unanswered this long was lost with the gateway that claimed it."""
    return timedelta(seconds=settings.GATEWAY_TOTAL_TIMEOUT + 60)


class Runner:
    def __init__(self, public_id: str, holder: str):
        self.batch = Batch.objects.select_related("input_file").get(public_id=public_id)
        self.holder = holder
        self.url = settings.SERVING_GATEWAY_URL.rstrip("/") + self.batch.endpoint
        self.inflight: dict = {}  # future → line index
        self.not_before: dict[int, float] = {}  # line index → when it may be sent again (monotonic)
        self.backoff: dict[int, float] = {}

    def run(self) -> str:
        batch = self.batch
        if batch.status == S.VALIDATING or (batch.status == S.CANCELLING and not batch.lines.exists()):
            self._start()  # (cancelled before it started: its lines are still written, as cancelled)
        if batch.status in (S.IN_PROGRESS, S.CANCELLING):
            outcome = self._send_all()
            if outcome is not None:
                return outcome
        if batch.status == S.FINALIZING:
            self._finalize()
        return batch.status

    # -- start ------------------------------------------------------------------------------------

    def _start(self) -> None:
        batch = self.batch
        try:
            if batch.input_file is None:
                raise InvalidBatchFile("The batch's input file was deleted.", details={"reason": "deleted"})
            requests = list(files.requests(files.path_of(batch.input_file)))
        except (InvalidBatchFile, OSError) as error:
            message = getattr(error, "message", None) or f"The input file cannot be read: {error}"
            self._end(S.FAILED, errors={"object": "list", "data": [
                {"code": "invalid_input_file", "message": message, "param": "input_file_id", "line": None}]})
            return
        with transaction.atomic():
            BatchLine.objects.bulk_create([BatchLine(batch=batch, index=r.index, custom_id=r.custom_id)
                                           for r in requests], batch_size=1000, ignore_conflicts=True)
            Batch.objects.filter(pk=batch.pk).update(total=len(requests))
            Batch.objects.filter(pk=batch.pk, status=S.VALIDATING).update(status=S.IN_PROGRESS,
                                                                          in_progress_at=timezone.now())
        batch.refresh_from_db()

    # -- sending ----------------------------------------------------------------------------------

    def _send_all(self) -> str | None:
        batch = self.batch
        requests = list(files.requests(files.path_of(batch.input_file)))
        renew_every = settings.BATCH_LEASE_SECONDS / 3
        renewed = counted = time.monotonic()
        timeout = httpx.Timeout(settings.GATEWAY_TOTAL_TIMEOUT + settings.GATEWAY_SLOT_WAIT
                                + settings.GATEWAY_ADMISSION_TIMEOUT + 30, connect=10)
        concurrency = settings.BATCH_CONCURRENCY
        with httpx.Client(timeout=timeout) as http, ThreadPoolExecutor(concurrency) as pool, \
                open(files.path_of(batch.input_file), "rb") as handle:
            while True:
                now = time.monotonic()
                if now - renewed >= renew_every:
                    held, _ = lease.claim(LEASE + batch.public_id, self.holder, settings.BATCH_LEASE_SECONDS)
                    if not held:  # another worker took it over: what this one sent is the gateway's to finish
                        log.warning("batch %s: lease lost; leaving it to its new runner", batch.public_id)
                        return "lease lost"
                    renewed = now
                batch.refresh_from_db(fields=["status"])
                stop = (CANCELLED_LINE if batch.status == S.CANCELLING
                        else EXPIRED_LINE if timezone.now() >= batch.expires_at else None)
                self._interrupted()
                if stop is None:
                    self._dispatch(pool, http, handle, requests, concurrency - len(self.inflight), now)
                if not self.inflight:
                    left = batch.lines.filter(state__in=(BatchLine.State.PENDING, BatchLine.State.RUNNING))
                    if stop is not None and not left.filter(state=BatchLine.State.RUNNING).exists():
                        code, message = stop
                        lines.finish(Q(batch=batch, state=BatchLine.State.PENDING), None, b"", code, message)
                        self._finish_sending()
                        return None
                    if stop is None and not left.exists():
                        self._finish_sending()
                        return None
                    time.sleep(0.2)  # lines deferred, or in flight in a gateway from an earlier worker
                else:
                    done, _ = wait(list(self.inflight), timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in done:
                        self._outcome(self.inflight.pop(future), future.result())
                if time.monotonic() - counted >= COUNT_EVERY_S:
                    self._count()
                    counted = time.monotonic()

    def _dispatch(self, pool, http, handle, requests, free: int, now: float) -> None:
        if free <= 0:
            return
        sending = set(self.inflight.values())
        deferred = [i for i, at in self.not_before.items() if at > now]
        pending = self.batch.lines.filter(state=BatchLine.State.PENDING).exclude(index__in=[*sending, *deferred]) \
            .order_by("index").values_list("index", flat=True)[:free]
        for index in pending:
            body = files.body_of(handle, requests[index])
            self.inflight[pool.submit(self._send, http, index, body)] = index

    def _send(self, http: httpx.Client, index: int, body: bytes):
        """(status, retry-after seconds, body, error code); status None when the gateway was not reached."""
        try:
            answer = http.post(self.url, content=body, headers={
                "content-type": "application/json", "x-berth-batch": lines.sign(self.batch.public_id, index)})
        except httpx.HTTPError as exc:
            return None, None, str(exc).encode(), "gateway_unreachable"
        try:
            code = str((orjson.loads(answer.content).get("error") or {}).get("code") or "") \
                if answer.status_code >= 300 else ""
        except (orjson.JSONDecodeError, AttributeError):
            code = ""
        try:
            retry = float(answer.headers.get("retry-after", ""))
        except ValueError:
            retry = None
        return answer.status_code, retry, answer.content, code

    def _outcome(self, index: int, result) -> None:
        status, retry, body, code = result
        self.not_before.pop(index, None)
        pending = Q(batch=self.batch, index=index, state=BatchLine.State.PENDING)
        if not BatchLine.objects.filter(pending).exists():
            self.backoff.pop(index, None)
            return  # the gateway claimed it and keeps its answer
        if status is None or code in lines.RETRY_LATER or (status in (429, 502, 503) and not code):
            delay = self.backoff.get(index, 0.5) * 2
            self.backoff[index] = min(delay, MAX_BACKOFF_S)
            self.not_before[index] = time.monotonic() + max(retry or 0, min(delay, MAX_BACKOFF_S))
            return
        self.backoff.pop(index, None)
        if code == "batch_line_taken":
            return
        if code in lines.KEY_REFUSED:  # no line of it can run any more
            lines.finish(Q(batch=self.batch, state=BatchLine.State.PENDING), status, body, code)
            return
        lines.finish(pending, status, body, code)

    def _interrupted(self) -> None:
        cutoff = timezone.now() - interrupted_after()
        sending = list(self.inflight.values())
        lines.finish(Q(batch=self.batch, state=BatchLine.State.RUNNING, claimed_at__lt=cutoff) & ~Q(index__in=sending),
                     None, b"", "interrupted", "The gateway that sent this request stopped before it answered; "
                                               "it was not sent again.")

    def _count(self) -> None:
        tally = dict(self.batch.lines.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
        Batch.objects.filter(pk=self.batch.pk).update(completed=tally.get(BatchLine.State.DONE, 0),
                                                      failed=tally.get(BatchLine.State.FAILED, 0))

    def _finish_sending(self) -> None:
        self._count()
        Batch.objects.filter(pk=self.batch.pk).update(status=S.FINALIZING, finalizing_at=timezone.now())
        self.batch.refresh_from_db()

    # -- the end ----------------------------------------------------------------------------------

    def _finalize(self) -> None:
        """Output and error files from the lines, then the batch's last state; the answers then live
        only in the files."""
        batch = self.batch
        if batch.cancelling_at is not None:
            final = S.CANCELLED
        elif batch.lines.filter(error_code=EXPIRED_LINE[0]).exists():
            final = S.EXPIRED
        else:
            final = S.COMPLETED
        with transaction.atomic():
            output = files.write_output(files.new_id("file-"), f"{batch.public_id}_output.jsonl",
                                        self._lines(ok=True), batch.client_id)
            errors = files.write_output(files.new_id("file-"), f"{batch.public_id}_error.jsonl",
                                        self._lines(ok=False), batch.client_id)
            batch.lines.update(response="")
            self._count()
            self._end(final, output_file=output, error_file=errors)

    def _lines(self, ok: bool):
        query = self.batch.lines.filter(state=BatchLine.State.DONE if ok else BatchLine.State.FAILED)
        for line in query.order_by("index").iterator(chunk_size=500):
            ident = "batch_req_" + hashlib.sha256(f"{self.batch.public_id}:{line.index}".encode()).hexdigest()[:24]
            if line.status_code is None:  # never answered: cancelled, expired, interrupted
                item = {"id": ident, "custom_id": line.custom_id, "response": None,
                        "error": {"code": line.error_code, "message": line.error_message}}
            else:
                try:
                    body = orjson.loads(line.response)
                except orjson.JSONDecodeError:
                    body = line.response
                item = {"id": ident, "custom_id": line.custom_id, "response": {
                    "status_code": line.status_code, "request_id": line.request_id, "body": body}, "error": None}
            yield orjson.dumps(item)

    def _end(self, status: str, **fields) -> None:
        stamp = {S.COMPLETED: "completed_at", S.FAILED: "failed_at", S.EXPIRED: "expired_at",
                 S.CANCELLED: "cancelled_at"}[status]
        Batch.objects.filter(pk=self.batch.pk).update(status=status, **{stamp: timezone.now()}, **fields)
        self.batch.refresh_from_db()
