"""Traces of gateway requests, exported over OTLP/HTTP (JSON) when an endpoint is configured.

With no endpoint (the default) nothing is recorded: every span is ``NOT_RECORDING``, whose methods
do nothing, so a request pays one attribute read. With one, a request is a server span (its request
id, model, status and tokens) with children for authentication, limits, admission while the model
loads and each upstream attempt; a client's W3C ``traceparent`` is continued, and the upstream
attempt's own is sent on to the engine. Finished spans wait in a bounded buffer (the newest are
dropped when the collector is slower than the traffic, and counted) and a background task posts
them in batches: a slow or absent collector never holds up a request.

Configured by OpenTelemetry's own variables: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL)
or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` added), ``OTEL_EXPORTER_OTLP_HEADERS``
(``key=value,...``, for a collector's token), ``OTEL_SERVICE_NAME`` and
``OTEL_TRACES_SAMPLER_ARG`` (the ratio of new traces kept; a client's sampled flag is followed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import re
import time
import urllib.parse

import httpx
import orjson

log = logging.getLogger(__name__)

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
SERVER, CLIENT, INTERNAL = 2, 3, 1  # OTLP's SpanKind values
STATUS_ERROR = 2


def parse_traceparent(value: str | None) -> tuple[str, str, bool] | None:
    """(trace id, parent span id, sampled) of a valid version-00 ``traceparent``, else None (an
    invalid one is ignored, as W3C Trace Context asks: the request starts a trace of its own)."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    trace_id, parent_id, flags = match.groups()
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id, parent_id, bool(int(flags, 16) & 1)


def _value(value) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


class _NotRecording:
    """The span of a request nobody traces: every method does nothing, ``child`` is itself."""

    recording = False
    traceparent = None

    def child(self, name: str, kind: int = INTERNAL, **attributes) -> _NotRecording:
        return self

    def set(self, key: str, value) -> None:
        pass

    def error(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        pass


NOT_RECORDING = _NotRecording()


class Span:
    recording = True
    __slots__ = ("tracer", "trace_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns",
                 "attributes", "status")

    def __init__(self, tracer: Tracer, trace_id: str, parent_id: str | None, name: str, kind: int, attributes):
        self.tracer = tracer
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64).to_bytes(8, "big").hex()
        self.parent_id = parent_id
        self.name = name
        self.kind = kind
        self.start_ns = time.time_ns()
        self.end_ns = None
        self.attributes = dict(attributes)
        self.status = None  # None: unset; else an error's message

    @property
    def traceparent(self) -> str:
        """This span as the parent of what it calls (sampled: it is recorded)."""
        return f"00-{self.trace_id}-{self.span_id}-01"

    def child(self, name: str, kind: int = INTERNAL, **attributes) -> Span:
        return Span(self.tracer, self.trace_id, self.span_id, name, kind, attributes)

    def set(self, key: str, value) -> None:
        if value is not None:
            self.attributes[key] = value

    def error(self, message: str) -> None:
        self.status = message

    def end(self) -> None:
        if self.end_ns is None:
            self.end_ns = time.time_ns()
            self.tracer.finished(self)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None and self.status is None:
            self.error(getattr(error, "code", None) or kind.__name__)
        self.end()

    def as_otlp(self) -> dict:
        span = {"traceId": self.trace_id, "spanId": self.span_id, "name": self.name, "kind": self.kind,
                "startTimeUnixNano": str(self.start_ns), "endTimeUnixNano": str(self.end_ns),
                "attributes": [{"key": k, "value": _value(v)} for k, v in self.attributes.items()]}
        if self.parent_id:
            span["parentSpanId"] = self.parent_id
        if self.status is not None:
            span["status"] = {"code": STATUS_ERROR, "message": str(self.status)[:200]}
        return span


def _headers(raw: str) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS``: ``key=value`` pairs, comma-separated, values URL-encoded."""
    headers = {}
    for pair in raw.split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            headers[key.strip()] = urllib.parse.unquote(value.strip())
    return headers


class Tracer:
    """Starts request spans and exports finished ones. ``endpoint`` None: records nothing."""

    def __init__(self, endpoint: str | None, *, headers: dict | None = None, service: str = "berth-gateway",
                 ratio: float = 1.0, buffer: int = 4096, batch: int = 512, interval_s: float = 1.0):
        self.endpoint = endpoint
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.service = service
        self.ratio = min(1.0, max(0.0, ratio))
        self.batch = batch
        self.interval_s = interval_s
        self._spans: collections.deque[Span] = collections.deque()
        self._buffer = buffer
        self.dropped = 0  # spans lost to a full buffer or a collector that refused them
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    @classmethod
    def from_environ(cls, environ=os.environ) -> Tracer:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if not endpoint and environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
            endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + "/v1/traces"
        if endpoint and urllib.parse.urlsplit(endpoint).scheme not in ("http", "https"):
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT must be an http(s) URL, not {endpoint!r}")
        try:
            ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1") or "1")
        except ValueError:
            raise ValueError("OTEL_TRACES_SAMPLER_ARG must be a number between 0 and 1") from None
        return cls(endpoint or None, headers=_headers(environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")),
                   service=environ.get("OTEL_SERVICE_NAME", "").strip() or "berth-gateway", ratio=ratio)

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    def start(self, name: str, traceparent: str | None, **attributes):
        """The server span of a request: continuing the client's trace when it sent one (and kept
        only when the client sampled it), else a new trace kept by ``ratio``."""
        if self.endpoint is None:
            return NOT_RECORDING
        parent = parse_traceparent(traceparent)
        if parent is not None:
            trace_id, parent_id, sampled = parent
            if not sampled:
                return NOT_RECORDING
        else:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return NOT_RECORDING
            trace_id, parent_id = random.getrandbits(128).to_bytes(16, "big").hex(), None
        return Span(self, trace_id, parent_id, name, SERVER, attributes)

    def finished(self, span: Span) -> None:
        if len(self._spans) >= self._buffer:
            self.dropped += 1
            return
        self._spans.append(span)
        if len(self._spans) >= self.batch:
            self._wake.set()

    # -- export --------------------------------------------------------------------------------

    def begin(self) -> None:
        """Start the exporting task (on the running loop); nothing when not enabled."""
        if self.endpoint is not None and self._task is None:
            self._client = httpx.AsyncClient(timeout=5.0)
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Export what is buffered, then stop."""
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        while self._spans and await self.export():
            pass
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            while self._spans and await self.export() and len(self._spans) >= self.batch:
                pass

    def body(self, spans: list[Span]) -> bytes:
        return orjson.dumps({"resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": self.service}}]},
            "scopeSpans": [{"scope": {"name": "berth.gateway"}, "spans": [s.as_otlp() for s in spans]}]}]})

    async def export(self) -> bool:
        """Post one batch; False when the collector could not take it (the batch is dropped and
        counted: a trace is worth less than the memory a backlog would hold)."""
        spans = [self._spans.popleft() for _ in range(min(self.batch, len(self._spans)))]
        if not spans:
            return True
        try:
            response = await self._client.post(self.endpoint, content=self.body(spans), headers=self.headers)
            if response.status_code < 300:
                return True
            log.warning("the trace collector refused %d spans: HTTP %s", len(spans), response.status_code)
        except httpx.HTTPError as exc:
            log.warning("could not export %d spans: %s", len(spans), exc)
        self.dropped += len(spans)
        return False
