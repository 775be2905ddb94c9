"""Usage records and the access log, written off the hot path.

The request path appends a plain dict to a list (no I/O); a task flushes the list every
``GATEWAY_USAGE_FLUSH_MS`` or at ``GATEWAY_USAGE_BATCH`` records, in a database thread, with one
``COPY`` (``bulk_create`` on SQLite). A batch the database refuses is parked on a Redis list and retried by the Celery
task ``gateway.tasks.retry_usage`` (or ``manage.py gateway_usage --retry``). Records carry no
request or response content, by construction: the dict has no field for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timezone
from decimal import Decimal

import orjson
from django.db import connection, transaction

from gateway.models import ModelPrice, UsageRecord
from gateway.threads import run_db
from serving import load
from serving.catalog import speed

log = logging.getLogger(__name__)
access_log = logging.getLogger("berth.gateway.access")

RETRY_LIST = "berth:gw:usage:retry"
FIELDS = ("request_id", "started_at", "finished_at", "endpoint", "stream", "model_asked", "model_served",
          "replica_id", "status", "error_code", "queue_ms", "ttft_ms", "total_ms", "prompt_tokens",
          "completion_tokens", "credential_id", "key_prefix", "client_id", "project_id", "scope_path")


def _prices(models: set[str]) -> dict[str, tuple[Decimal, Decimal]]:
    return {row.model_name: (row.prompt_per_1k, row.completion_per_1k)
            for row in ModelPrice.objects.filter(model_name__in=models)}


COLUMNS = FIELDS + ("cost",)


def _values(row: dict, prices: dict[str, tuple[Decimal, Decimal]]) -> tuple:
    """One record's column values in ``COLUMNS`` order, priced."""
    values = {name: row.get(name) for name in FIELDS}
    for name in ("started_at", "finished_at"):
        if isinstance(values[name], (int, float)):
            values[name] = datetime.fromtimestamp(values[name], timezone.utc)
    for name in ("model_asked", "model_served", "error_code", "key_prefix", "scope_path", "endpoint"):
        values[name] = values[name] or ""
    price = prices.get(values["model_served"])
    cost = None
    if price is not None and (values["prompt_tokens"] is not None or values["completion_tokens"] is not None):
        cost = (Decimal(values["prompt_tokens"] or 0) * price[0]
                + Decimal(values["completion_tokens"] or 0) * price[1]) / 1000
    return (*(values[name] for name in FIELDS), cost)


def write_batch(rows: list[dict]) -> int:
    """Insert ``rows`` (dicts of ``FIELDS``, times as Unix seconds), pricing them, all or none.
    Database. On PostgreSQL with one ``COPY`` (a tenth of ``bulk_create``'s cost a record, which
    the gateway's process would otherwise spend beside its requests); elsewhere ``bulk_create``."""
    prices = _prices({row["model_served"] for row in rows if row.get("model_served")})
    values = [_values(row, prices) for row in rows]
    with transaction.atomic():
        if connection.vendor == "postgresql":
            meta = UsageRecord._meta
            columns = ", ".join(connection.ops.quote_name(meta.get_field(name).column) for name in COLUMNS)
            with connection.cursor() as cursor:
                with cursor.cursor.copy(f"COPY {connection.ops.quote_name(meta.db_table)} ({columns}) FROM STDIN") \
                        as copy:
                    for record in values:
                        copy.write_row(record)
        else:
            UsageRecord.objects.bulk_create([UsageRecord(**dict(zip(COLUMNS, record))) for record in values],
                                            batch_size=1000)
    return len(values)


def _tell_serving(rows: list[dict]) -> None:
    """Tell Serving what a batch says: when each model was last served (idle on-demand models are
    unloaded after their timeout) and how fast each catalog profile generated (placement prefers
    the faster). A missed note only delays an unload or a preference; the usage still gets written."""
    last: dict[str, float] = {}
    for row in rows:
        name, at = row.get("model_served"), row.get("finished_at") or row.get("started_at")
        if name and isinstance(at, (int, float)):
            last[name] = max(at, last.get(name, 0.0))
    for what, note in (("when models were last used", lambda: load.note_used(last)),
                       ("how fast profiles generated", lambda: speed.note(rows))):
        try:
            note()
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("could not note %s", what)


def park(rows: list[dict], redis_url: str | None) -> None:
    """Keep a batch the database refused, for the retry task."""
    if not redis_url:
        log.error("dropped %d usage records: the database refused them and there is no Redis", len(rows))
        return
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        client.rpush(RETRY_LIST, *[json.dumps(row) for row in rows])
    finally:
        client.close()


def write_or_park(rows: list[dict], redis_url: str | None) -> None:
    _tell_serving(rows)
    try:
        write_batch(rows)
    except Exception:  # noqa: BLE001 - any database failure: keep the rows for the retry task
        log.exception("writing %d usage records failed; parked for retry", len(rows))
        park(rows, redis_url)


def retry_parked(redis_url: str | None, limit: int = 10_000) -> int:
    """Write parked records (the Celery task and the management command call this)."""
    if not redis_url:
        return 0
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    written = 0
    try:
        while written < limit:
            raw = client.lpop(RETRY_LIST, 500)
            if not raw:
                break
            rows = [json.loads(item) for item in raw]
            try:
                written += write_batch(rows)
            except Exception:
                client.rpush(RETRY_LIST, *raw)
                raise
    finally:
        client.close()
    return written


class UsageRecorder:
    def __init__(self, flush_ms: int, batch: int, redis_url: str | None, access_log_on: bool = True):
        self.interval = flush_ms / 1000
        self.batch = batch
        self.redis_url = redis_url
        self.access_log_on = access_log_on
        self._pending: list[dict] = []
        self._lines: list[bytes] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def add(self, row: dict | None, line: dict) -> None:
        """One request's record (``row``, None when nobody is to be charged) and access-log line."""
        if self.access_log_on:
            self._lines.append(orjson.dumps(line))
        if row is not None:
            self._pending.append(row)
            if len(self._pending) >= self.batch:
                self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.flush()

    def write_log(self) -> None:
        """The access log: one JSON object a line, written with one call per flush (not per request)."""
        if self._lines:
            lines, self._lines = self._lines, []
            if access_log.isEnabledFor(logging.INFO):
                access_log.info("\n".join(line.decode() for line in lines))

    async def flush(self) -> None:
        self.write_log()
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        try:
            await run_db(write_or_park, rows, self.redis_url)
        except Exception:  # noqa: BLE001 - parking failed too (no Redis): logged, never raised into serving
            log.exception("lost %d usage records", len(rows))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.flush()
