"""The inference gateway: a lean ASGI application serving /v1/ (mounted by ``berth.asgi``).

Django's request path costs milliseconds a request; this path costs a fraction of one. On the hot
path there is no database access: keys come from an in-process cache (``gateway.auth``), the routing
table from another (``serving.control.routing.RoutingCache``), limits cost one Redis round trip
(``gateway.limits``), usage and the access log are queued and written in batches
(``gateway.usage``). Requests go to engines over one pooled aiohttp session.

Order on every request: request id (set on every response, refusals included) → route → key
(before the body is read) → body (its shape and token counts, ``gateway.bodies``) → model allowed
and known → the output it asks for within the model's cap or context → a model whose engine serves
the route (``gateway.routes``) → limits → a ready replica (or admission while the model loads) → the
engine, retried once on another replica when the connection fails → the answer, streamed as it comes
→ usage, log line and metrics.

Every inference route takes that one path: OpenAI's chat completions, completions, embeddings and
rerank, its Responses API (``/v1/responses``, ``/v1/responses/input_tokens``) and Anthropic's Messages
API (``/v1/messages``, ``/v1/messages/count_tokens``), so each is charged to the same limits and
budgets. What differs per API is data: the field a model's output cap is sent in, where a stream tells
its usage and its end, and the shape of an error (Anthropic's on the Messages routes). A key is read
from ``Authorization: Bearer`` or, as Anthropic's clients send it, ``x-api-key``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import os
import re
import socket
import time

import aiohttp
import orjson
from django.conf import settings

from berth.errors import BerthError
from gateway import bodies, fleet_metrics, metrics, routes, splits, tracing
from gateway.auth import BATCH, AuthCache, Principal, load_batch_principal
from gateway.batch import lines
from gateway.errors import (
    ANTHROPIC_ERROR_TYPES,
    ERROR_TYPES,
    BadRequest,
    BatchLineTaken,
    BatchSignatureInvalid,
    EndpointNotFound,
    EnvironmentNotAllowed,
    InferenceNotAllowed,
    LimiterUnavailable,
    MethodNotAllowed,
    MetricsNotAllowed,
    MissingKey,
    ModelLoading,
    ModelNotAllowed,
    ModelNotFound,
    NoReplica,
    QueueFull,
    RouteNotServed,
    TooLarge,
    UpstreamError,
    UpstreamTimeout,
    shown,
)
from gateway.limits import Limiter, LocalLimiter, limiter_client
from gateway.slots import RANK, SlotGate
from gateway.threads import run_db
from gateway.upstream import Balancer
from gateway.usage import UsageRecorder
from serving import load
from serving.control import ondemand, routing
from serving.events import ROUTING_CHANNEL
from serving.models.states import LOADABLE
from tenancy import events
from tenancy.services.clients import credential_from_header

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# OpenAI's chat and completions name them prompt/completion tokens; Responses and Anthropic's Messages
# input/output tokens (``input_tokens_details`` and ``cache_read_input_tokens`` do not match).
_PROMPT = re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')
_TOTAL = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
# Anthropic's input_tokens leave out the prompt tokens read from (or written to) its cache: added back,
# so a prompt counts the same through every API.
_CACHED_INPUT = re.compile(rb'"cache_(?:read|creation)_input_tokens"\s*:\s*(\d+)')

# path -> (endpoint name, upstream path, required fields). One pipeline (``infer``) serves them all.
INFERENCE = {
    "/v1/chat/completions": ("chat/completions", "/v1/chat/completions", ("messages",)),
    "/v1/completions": ("completions", "/v1/completions", ("prompt",)),
    "/v1/embeddings": ("embeddings", "/v1/embeddings", ("input",)),
    "/v1/rerank": ("rerank", "/v1/rerank", ("query", "documents")),
    "/v1/responses": ("responses", "/v1/responses", ("input",)),
    "/v1/responses/input_tokens": ("responses/input_tokens", "/v1/responses/input_tokens", ("input",)),
    # Anthropic's API requires max_tokens (its clients always send it); so does Berth's gateway.
    "/v1/messages": ("messages", "/v1/messages", ("messages", "max_tokens")),
    "/v1/messages/count_tokens": ("messages/count_tokens", "/v1/messages/count_tokens", ("messages",)),
}
STREAMING = {"chat/completions", "completions", "responses", "messages"}
ASKS_USAGE = {"chat/completions", "completions"}  # a stream tells its usage only when asked to
COUNTING = {"responses/input_tokens", "messages/count_tokens"}  # count a prompt's tokens; run no model
ANTHROPIC = {"messages", "messages/count_tokens"}  # answered in Anthropic's shapes, errors included
ANTHROPIC_PATHS = {path for path, (endpoint, *_) in INFERENCE.items() if endpoint in ANTHROPIC}
# What marks a stream's last event: a client that leaves after it left satisfied.
STREAM_END = {"responses": b"event: response.completed", "messages": b"event: message_stop"}


class ClientGone(Exception):
    """The client closed the connection before the answer: logged as 499, nothing sent."""


class Call:
    """One request's facts as it goes (no content: bodies are never kept here)."""

    __slots__ = ("receive", "send", "method", "path", "request_id", "rid_bytes", "started", "started_wall",
                 "authorization", "api_key", "content_length", "principal", "endpoint", "model_asked", "model_label",
                 "replica_id", "status", "error_code", "queue_ms", "ttft_ms", "prompt_tokens", "completion_tokens",
                 "stream", "extra_headers", "response_started", "finished", "disconnected", "saw_done",
                 "traceparent", "span", "batch_header", "batch")

    def __init__(self, scope, receive, send):
        self.receive = receive
        self.send = send
        self.method = scope["method"]
        self.path = scope["path"]
        self.started = time.perf_counter()
        self.started_wall = time.time()
        self.authorization = None
        self.api_key = None  # ``x-api-key``, as Anthropic's clients send the key
        self.content_length = None
        self.traceparent = None  # the client's W3C trace context, continued (``gateway.tracing``)
        self.batch_header = None  # a batch's line, sent by the worker running it (``gateway.batch.lines``)
        self.batch = None
        request_id = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                self.authorization = value
            elif name == b"x-api-key":
                self.api_key = value
            elif name == b"x-request-id":
                request_id = value
            elif name == b"content-length":
                self.content_length = value
            elif name == b"traceparent":
                self.traceparent = value.decode("latin-1")
            elif name == lines.HEADER:
                self.batch_header = value
        if request_id is not None:
            try:
                request_id = request_id.decode("ascii")
            except UnicodeDecodeError:
                request_id = None
        if request_id is None or not _REQUEST_ID.match(request_id):
            request_id = "req_" + os.urandom(12).hex()
        self.request_id = request_id
        self.rid_bytes = request_id.encode()
        self.span = tracing.NOT_RECORDING
        self.principal: Principal | None = None
        self.endpoint = ""
        self.model_asked = ""
        self.model_label = "unknown"
        self.replica_id = None
        self.status = 500
        self.error_code = ""
        self.queue_ms = None
        self.ttft_ms = None
        self.prompt_tokens = None
        self.completion_tokens = None
        self.stream = False
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.response_started = False
        self.finished = False
        self.disconnected = False
        self.saw_done = False  # the stream's last event went out: a client leaving now left satisfied

    async def respond(self, status: int, body: bytes, content_type: bytes = b"application/json",
                      headers: list | None = None) -> None:
        self.status = status
        hdrs = [(b"x-request-id", self.rid_bytes), (b"content-type", content_type),
                (b"content-length", str(len(body)).encode())]
        if self.extra_headers:
            hdrs += self.extra_headers
        if headers:
            hdrs += headers
        if self.batch is not None and self.batch.claimed:  # kept before the worker hears it (it may be gone)
            try:
                await run_db(lines.settle, self.batch, status, body, self.error_code)
            except Exception as exc:  # noqa: BLE001 - the line stays running: its worker reports it interrupted
                log.warning("request %s: the answer of batch line %s:%s could not be kept: %r", self.request_id,
                            self.batch.batch, self.batch.index, exc)
        self.response_started = True
        self.finished = True
        await self.send({"type": "http.response.start", "status": status, "headers": hdrs})
        await self.send({"type": "http.response.body", "body": body})


def error_body(error: BerthError, anthropic: bool = False) -> bytes:
    """OpenAI's error shape, or with ``anthropic`` Anthropic's (``{"type": "error", "error": {"type",
    "message"}}``); Berth's stable ``code`` (and ``param``, ``details``) in both."""
    types = ANTHROPIC_ERROR_TYPES if anthropic else ERROR_TYPES
    inner = {"message": error.message, "type": types.get(error.status, "api_error"), "code": error.code}
    param = getattr(error, "param", None)
    if param:
        inner["param"] = param
    if error.details:
        inner["details"] = error.details
    return orjson.dumps({"type": "error", "error": inner} if anthropic else {"error": inner})


def stream_error(endpoint: str, error: BerthError) -> bytes:
    """The event that ends a stream broken midway, in the stream's own API: Anthropic's ``error``
    event, the Responses API's ``error`` event, else an OpenAI error chunk."""
    if endpoint in ANTHROPIC:
        return b"event: error\ndata: " + error_body(error, anthropic=True) + b"\n\n"
    if endpoint == "responses":
        event = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + error_body(error) + b"\n\n"


def _usage_from(data: bytes, call: Call) -> None:
    """The tokens of the last ``usage`` object in ``data``, in any API's shape. Only what it holds is
    set: Anthropic's stream tells the input in ``message_start`` and the output in ``message_delta``."""
    match = None
    for match in _USAGE.finditer(data):
        pass
    if match is None:
        return
    tail = data[match.end():match.end() + 400]
    prompt = _PROMPT.search(tail)
    completion = _COMPLETION.search(tail)
    if prompt:
        call.prompt_tokens = int(prompt.group(1))
        if call.endpoint in ANTHROPIC:
            call.prompt_tokens += sum(int(n) for n in _CACHED_INPUT.findall(tail))
    if completion:
        call.completion_tokens = int(completion.group(1))
    elif prompt:  # embeddings and rerank: prompt (and total) tokens only
        call.completion_tokens = 0
    if not prompt:
        total = _TOTAL.search(tail)
        if total:
            call.prompt_tokens, call.completion_tokens = int(total.group(1)), 0


class Gateway:
    def __init__(self):
        self.ready = False
        self._starting: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []
        # model → {call id: (when it began waiting, whether at the batch priority)}
        self.waiting: dict[str, dict[int, tuple[float, bool]]] = {}

    # -- life cycle ----------------------------------------------------------------------------

    async def startup(self) -> None:
        if self.ready:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.ready:
                return
            self.redis_url = settings.REDIS_URL
            self.redis = None
            if self.redis_url:
                import redis.asyncio as aioredis

                self.redis = aioredis.Redis.from_url(self.redis_url, max_connections=256, health_check_interval=30)
                # The limiter has a client of its own that fails fast (a stalled Redis is 503
                # `limiter_unavailable` within the timeout); pub/sub on the one above waits for messages.
                limiter_redis = limiter_client(self.redis_url, settings.GATEWAY_REDIS_TIMEOUT)
            connector = aiohttp.TCPConnector(limit=2000, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300)
            self.session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",),
                                                 auto_decompress=False)
            self.timeout = aiohttp.ClientTimeout(total=settings.GATEWAY_TOTAL_TIMEOUT, sock_connect=10,
                                                 sock_read=settings.GATEWAY_FIRST_BYTE_TIMEOUT)
            self.auth = AuthCache(settings.GATEWAY_AUTH_CACHE_SECONDS)
            self.routing = routing.RoutingCache(settings.GATEWAY_ROUTING_TTL, run_db, loader=splits.load_table)
            lease = settings.GATEWAY_TOTAL_TIMEOUT + 60
            # Without Redis (the embedded mode, one process) the limits are kept in this process.
            self.limiter = (Limiter(limiter_redis, lease_seconds=lease) if self.redis is not None
                            else LocalLimiter(lease_seconds=lease))
            self.balancer = Balancer(settings.GATEWAY_BREAKER_FAILURES, settings.GATEWAY_BREAKER_SECONDS)
            self.recorder = UsageRecorder(settings.GATEWAY_USAGE_FLUSH_MS, settings.GATEWAY_USAGE_BATCH,
                                          self.redis_url, settings.GATEWAY_ACCESS_LOG)
            self.max_body = settings.GATEWAY_MAX_BODY_BYTES
            self.queue_size = settings.GATEWAY_ADMISSION_QUEUE
            self.admission_timeout = settings.GATEWAY_ADMISSION_TIMEOUT
            self.budget_output = settings.GATEWAY_BUDGET_OUTPUT_TOKENS
            self.slots = SlotGate(settings.GATEWAY_SLOT_QUEUE, settings.GATEWAY_SLOT_WAIT)
            self.recorder.start()
            self.tracer = tracing.Tracer.from_environ()
            self.tracer.begin()
            loop = asyncio.get_running_loop()
            # What this process changes itself (the console and the API run here; in the embedded
            # mode, everything does) reaches the caches at once, without Redis.
            self._stop_local = events.listen_locally(
                lambda channel, message: loop.call_soon_threadsafe(self._on_event, channel, message))
            if self.redis is not None:
                # Subscribed before the first request is served: a revocation published from now on
                # is heard (a request served before that could not be told of one).
                self._tasks.append(loop.create_task(self._listen(await self._subscribe())))
            self._tasks.append(loop.create_task(self._housekeeping()))
            self._tasks.append(loop.create_task(self._report_load()))
            self.ready = True

    async def shutdown(self) -> None:
        if not self.ready:
            return
        self._stop_local()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.recorder.stop()
        await self.tracer.close()  # what is buffered is exported first
        await self.limiter.aclose()  # settlements sent, then its client closed
        await self.session.close()
        if self.redis is not None:
            await self.redis.aclose()
        self.ready = False

    def _on_event(self, channel: str, message: str) -> None:
        if channel == events.CREDENTIAL_REVOKED:
            self.auth.drop_lookup(message)
        elif channel == ROUTING_CHANNEL:
            self.routing.invalidate()

    async def _heard(self, channel: str, message: str) -> None:
        """An event from Redis: acted on, then acknowledged when its publisher waits (a revocation
        returns once every gateway process has dropped the key)."""
        event, ack = events.received(message)
        self._on_event(channel, event)
        if ack:
            try:
                await self.redis.publish(ack, b"1")
            except Exception as exc:  # noqa: BLE001 - the publisher stops waiting on its own
                log.warning("could not acknowledge %s: %s", channel, exc)

    async def _subscribe(self):
        """A subscription Redis has confirmed (or None when Redis cannot be reached now: ``_listen``
        keeps trying). The key cache starts over: what was published before cannot be known."""
        pubsub = self.redis.pubsub()
        channels = {events.CREDENTIAL_REVOKED.encode(), ROUTING_CHANNEL.encode()}
        try:
            async with asyncio.timeout(5):
                await pubsub.subscribe(*channels)
                while channels:  # SUBSCRIBE is answered by one confirmation a channel
                    message = await pubsub.get_message(timeout=1)
                    if message is not None and message.get("type") == "subscribe":
                        channels.discard(message["channel"])
        except Exception as exc:  # noqa: BLE001 - Redis unreachable or slow: the caches' lifetimes cover it
            log.warning("gateway event subscription failed (%s); retrying", exc)
            try:
                await pubsub.aclose()
            except Exception:  # noqa: BLE001
                pass
            return None
        self.auth.clear()
        self.routing.invalidate()
        return pubsub

    async def _listen(self, pubsub) -> None:
        """Revocations and routing changes, from every process, over Redis pub/sub."""
        while True:
            if pubsub is None:
                await asyncio.sleep(1)
                pubsub = await self._subscribe()
                continue
            try:
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self._heard(message["channel"].decode(), message["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect; the caches' lifetimes cover the gap
                log.warning("gateway event subscription lost (%s); reconnecting", exc)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass
            pubsub = None

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(30)
            self.auth.purge()

    async def _report_load(self) -> None:
        """Tell the placement loop what this process has in flight per replica and waiting per model
        (active replicas are never evicted; waiting and busy models are wanted). Silent while idle:
        a report goes out while there is load, and once more when it ends."""
        process = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        reported = False
        try:
            while True:
                await asyncio.sleep(load.PUBLISH_EVERY_S)
                busy = dict(self.balancer.outstanding)
                waiting = {m: len(calls) for m, calls in self.waiting.items() if calls}
                since = {m: min(began for began, _ in calls.values()) for m, calls in self.waiting.items() if calls}
                batch = {m: sum(b for _, b in calls.values()) for m, calls in self.waiting.items() if calls}
                if not busy and not waiting and not reported:
                    continue
                try:
                    await run_db(load.publish, process, busy, waiting, waiting_since=since, waiting_batch=batch)
                    reported = bool(busy or waiting)
                except Exception as exc:  # noqa: BLE001 - the next report follows in a few seconds
                    log.warning("could not report load: %s", exc)
        finally:
            if reported:
                try:
                    await asyncio.shield(run_db(load.withdraw, process))
                except Exception:  # noqa: BLE001 - the report goes stale on its own
                    pass

    # -- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if not self.ready:
            await self.startup()
        call = Call(scope, receive, send)
        if self.tracer.enabled:  # untraced, a request builds no span (``NOT_RECORDING`` from Call)
            call.span = self.tracer.start(f"{call.method} {call.path}", call.traceparent,
                                          **{"http.request.method": call.method, "url.path": call.path,
                                             "berth.request_id": call.request_id})
        try:
            path = call.path
            if path in INFERENCE:
                if call.method != "POST":
                    raise MethodNotAllowed(f"{path} takes POST.")
                await self.infer(call, *INFERENCE[path])
            elif path == "/v1/models":
                if call.method != "GET":
                    raise MethodNotAllowed("/v1/models takes GET.")
                await self.models(call)
            elif path == "/metrics":
                self._allow_metrics(call, scope)
                body = metrics.render() + await run_db(fleet_metrics.render)  # the rows are read off the loop
                await call.respond(200, body, b"text/plain; version=0.0.4; charset=utf-8")
                return
            else:
                raise EndpointNotFound(f"No such endpoint: {call.method} {path}.")
        except BerthError as error:
            call.error_code = error.code
            if call.response_started:
                call.status = error.status
            else:
                await call.respond(error.status, error_body(error, call.path in ANTHROPIC_PATHS),
                                   headers=getattr(error, "headers", None))
        except ClientGone:
            call.status, call.error_code = 499, "client_closed_request"
        except asyncio.CancelledError:
            if not call.disconnected:
                raise
            asyncio.current_task().uncancel()
            call.status, call.error_code = 499, "client_closed_request"
        except Exception:
            log.exception("gateway request %s failed", call.request_id)
            call.error_code = "internal_error"
            if not call.response_started:
                await call.respond(500, error_body(BerthError("Something went wrong in the gateway; it is logged.",
                                                              code="internal_error", status=500),
                                                   call.path in ANTHROPIC_PATHS))
            call.status = 500
        finally:
            self._record(call)
            if call.span.recording:
                self._end_span(call)

    @staticmethod
    def _allow_metrics(call: Call, scope) -> None:
        """Prometheus's page names every model and its traffic: it answers the bearer of
        ``BERTH_METRICS_TOKEN`` or, with none set, only this machine (a loopback peer). The peer is
        read from ``scope`` here, not for every request."""
        token = settings.GATEWAY_METRICS_TOKEN
        if token:
            sent = (call.authorization or b"").decode("latin-1").removeprefix("Bearer ").strip()
            if hmac.compare_digest(sent.encode(), token.encode()):
                return
            raise MetricsNotAllowed("The metrics answer the bearer of the metrics token: send "
                                    "`Authorization: Bearer <BERTH_METRICS_TOKEN>`.")
        try:
            if ipaddress.ip_address((scope.get("client") or ("", 0))[0]).is_loopback:
                return
        except ValueError:
            pass  # a Unix socket or no peer at all: not known to be this machine
        raise MetricsNotAllowed("The metrics answer only this machine unless BERTH_METRICS_TOKEN is set: then "
                                "send it as a bearer token.")

    @staticmethod
    def _end_span(call: Call) -> None:
        span = call.span
        for key, value in (("http.response.status_code", call.status), ("gen_ai.request.model", call.model_asked),
                           ("gen_ai.response.model", call.model_label if call.model_label != "unknown" else None),
                           ("berth.replica_id", call.replica_id), ("gen_ai.usage.input_tokens", call.prompt_tokens),
                           ("gen_ai.usage.output_tokens", call.completion_tokens), ("error.type", call.error_code)):
            span.set(key, value or None)
        if call.status >= 500:
            span.error(call.error_code or str(call.status))
        span.end()

    async def _principal(self, call: Call) -> Principal:
        """The key's principal, from ``Authorization: Bearer`` or else ``x-api-key`` (any route)."""
        with call.span.child("authenticate"):
            return await self._authenticate(call)

    async def _authenticate(self, call: Call) -> Principal:
        if call.batch_header is not None:  # a batch's line: its key's principal at the batch priority
            call.batch = lines.verify(call.batch_header)
            if call.batch is None:
                raise BatchSignatureInvalid("The x-berth-batch header's signature does not hold.")
            principal = await self.auth.principal(BATCH + call.batch.batch, load_batch_principal)
            call.principal = principal
            return principal
        if call.authorization is not None:
            plaintext = credential_from_header(call.authorization.decode("latin-1"))
        elif call.api_key is not None and call.api_key.strip():
            plaintext = call.api_key.decode("latin-1").strip()
        else:
            raise MissingKey("No API key: send it as `Authorization: Bearer brk_…` or `x-api-key: brk_…`.")
        principal = await self.auth.principal(plaintext)
        call.principal = principal
        return principal

    async def _body(self, call: Call) -> bytes:
        if call.content_length is not None:
            try:
                if int(call.content_length) > self.max_body:
                    raise TooLarge(f"The request body is larger than {self.max_body} bytes.")
            except ValueError:
                raise BadRequest("Content-Length is not a number.") from None
        chunks = []
        size = 0
        while True:
            message = await call.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise TooLarge(f"The request body is larger than {self.max_body} bytes.")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def models(self, call: Call) -> None:
        call.endpoint = "models"
        principal = await self._principal(call)
        if not principal.may_infer:
            raise InferenceNotAllowed("This key's client may not use the inference API.")
        table = await self.routing.get()
        listed = splits.callable_models(table, principal.project_path, principal.environment, principal.allows)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "berth", "state": route.state,
                 "task": route.task} for name, route in sorted(listed.items())]
        await call.respond(200, orjson.dumps({"object": "list", "data": data}))

    async def infer(self, call: Call, endpoint: str, upstream_path: str, required: tuple[str, ...]) -> None:
        call.endpoint = endpoint
        principal = await self._principal(call)  # before the body is read
        if not principal.may_infer:
            raise InferenceNotAllowed("This key's client may not use the inference API.")
        body = await self._body(call)
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise BadRequest("The request body is not valid JSON.") from None
        if not isinstance(payload, dict):
            raise BadRequest("The request body must be a JSON object.")
        model = payload.get("model")
        if not isinstance(model, str) or not model.strip():
            raise BadRequest("`model` is required: the name of a model this key may use.", param="model")
        call.model_asked = model[:200]
        for field in required:
            if payload.get(field) is None:
                raise BadRequest(f"`{field}` is required.", param=field)
        bodies.check(endpoint, payload)
        stream = endpoint in STREAMING and payload.get("stream") is True
        if stream and call.batch is not None:
            raise BadRequest("A batch's requests cannot stream.", param="stream")
        call.stream = stream
        if not principal.allows(model):
            raise ModelNotAllowed(f"This key may not use the model {shown(model)!r}.", details={"model": shown(model)})
        table = await self.routing.get()
        served = self._resolve(table, model, principal)
        route = table.route(served)
        if route is None:
            # Perhaps deployed since the table was read (its change message still on the way, or no
            # Redis to carry one): answer from a table read after this request arrived.
            table = await self.routing.read_since(call.started)
            served = self._resolve(table, model, principal)
            route = table.route(served)
        if route is not None and not route.admits(principal.project_path):
            route = None  # another tenant's own model: as unknown to this key as one that does not exist
        if route is None:
            if served != model:
                raise ModelNotFound(f"The model {shown(served)!r} (a variant of {shown(model)!r}) does not exist.",
                                    details={"model": shown(model), "variant": shown(served)})
            raise ModelNotFound(f"The model {shown(model)!r} does not exist.", details={"model": shown(model)})
        output_cap = bodies.output_default(endpoint, payload, route)  # refused here, before any limit is spent
        route = routes.narrowed(route, endpoint)  # so is a route the model's engine does not serve
        call.model_label = route.name
        # Under a hard budget, what it may cost at most is held until it settles (no overshoot in flight);
        # counting a prompt's tokens costs none (refused only once the budget is used up).
        reserve, reserved_output = bodies.reservation(endpoint, payload, len(body), output_cap, route,
                                                      self.budget_output) \
            if principal.plan.reserves and endpoint not in COUNTING else (0, None)
        try:
            with call.span.child("limits"):
                admission = await self.limiter.admit(principal.plan, call.request_id, reserve)
        except BerthError:
            raise
        except Exception as exc:  # Redis unreachable or stalled past its timeout: refuse rather than serve unlimited
            log.warning("rate limiter unavailable: %r", exc)
            raise LimiterUnavailable("Rate limits cannot be checked right now; retry shortly.") from None
        call.extra_headers = admission.headers
        if admission.budget_warning:
            call.extra_headers.append((b"x-berth-budget-warning", b"a soft token budget of this key's scope is used up"))
        watcher = None
        try:
            if not route.endpoints:
                fallback = self._fallback(principal, table, route)
                if fallback is None:
                    with call.span.child("admission", **{"gen_ai.request.model": route.name}):
                        fallback = await self._admit_while_loading(call, route)
                route = fallback
                call.model_label = route.name  # a fallback serves under its own name
                output_cap = bodies.output_default(endpoint, payload, route)  # and within its own cap
                route = routes.narrowed(route, endpoint)  # and on the replicas (now ready) serving the route
            if reserved_output is not None:  # asked for no limit: at most what was reserved, whatever serves it
                output_cap = reserved_output if output_cap is None else min(output_cap, reserved_output)
            changed = False
            if output_cap is not None:  # the request named no limit: the model's cap is its limit
                payload[bodies.cap_field(endpoint)] = output_cap
                changed = True
            if route.by_priority:
                payload["priority"] = RANK.get(principal.priority, RANK["normal"])  # vLLM: lower is sooner
                changed = True
            if stream and endpoint in ASKS_USAGE:
                options = payload.get("stream_options")
                if not isinstance(options, dict) or options.get("include_usage") is not True:
                    payload["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                                 "include_usage": True}
                    changed = True
            if changed:
                body = orjson.dumps(payload)
            if call.batch is None:  # a batch's line is finished and kept even when its worker has gone
                watcher = asyncio.get_running_loop().create_task(self._watch(call, asyncio.current_task()))
            # Every slot busy: it waits its turn by its client's priority, not the engine's arrival order.
            async with self.slots.slot(route.name, route.slots, principal.priority):
                if call.batch is None:
                    await self._forward(call, route, upstream_path, body)
                else:
                    await self._forward_line(call, route, upstream_path, body)
        finally:
            if watcher is not None:
                watcher.cancel()
            tokens = (call.prompt_tokens or 0) + (call.completion_tokens or 0)
            self.limiter.settle(principal.plan, call.request_id, tokens, reserve)

    @staticmethod
    def _resolve(table: routing.RoutingTable, model: str, principal: Principal) -> str:
        """The model name to route: the asked one, or the variant of a split the caller's client sees
        (sticky per client). A split restricted to other environments refuses the caller. No I/O."""
        if not table.splits:
            return model
        split = splits.applicable(table, model, principal.project_path)
        if split is None:
            return model
        if not split.allows_environment(principal.environment):
            allowed = sorted(split.environments)
            raise EnvironmentNotAllowed(
                f"The model {shown(model)!r} may be used by {', '.join(allowed)} clients only; this key's client "
                f"is {principal.environment}.", details={"model": shown(model), "environments": allowed,
                                                         "environment": principal.environment})
        return split.choose(principal.client_id)

    async def _watch(self, call: Call, task: asyncio.Task) -> None:
        """Cancel the request when its client goes away (the engine's request is closed with it)."""
        while True:
            message = await call.receive()
            if message["type"] == "http.disconnect":
                if not call.finished and not call.saw_done:
                    call.disconnected = True
                    task.cancel()
                return

    @staticmethod
    def _fallback(principal, table, route: routing.ModelRoute) -> routing.ModelRoute | None:
        """The first of the model's fallbacks that is ready and that this key may use."""
        for name in route.fallbacks:
            candidate = table.route(name)
            if (candidate is not None and candidate.endpoints and principal.allows(name)
                    and candidate.admits(principal.project_path)):
                return candidate
        return None

    async def _admit_while_loading(self, call: Call, route: routing.ModelRoute) -> routing.ModelRoute:
        """Ask for the model to be loaded and wait, in a bounded queue, up to the admission timeout;
        then 503 ``model_loading`` with ``Retry-After`` from its expected load time. An always-on
        model the reconcile loop is bringing back (``LoadTicket.coming_back``) is waited for the
        same way; one that will not come up (parked, fits nowhere) is refused at once."""
        reask_s = 1.0  # while it is not loadable, asked again at most this often per waiting request
        model = route.name
        queued = self.waiting.setdefault(model, {})
        if len(queued) >= self.queue_size:
            raise QueueFull(f"Too many requests are waiting for {model} to load; retry later.",
                            details={"model": model, "queue": self.queue_size})
        batch = call.principal.priority == "batch"  # only room that is free: nothing is preempted for it
        queued[id(call)] = (time.time(), batch)
        metrics.WAITING.labels(model).inc()
        began = time.perf_counter()
        try:
            ticket = await run_db(ondemand.request_load, model, batch)  # NotLoadable: 503, no Retry-After
            asked = time.perf_counter()  # the ticket's expected seconds count from here
            deadline = began + self.admission_timeout
            while True:
                table = await self.routing.fresh()
                current = table.route(model)
                if current is not None and current.endpoints:
                    return current
                if (current is None or current.state not in LOADABLE) and time.perf_counter() - asked >= reask_s:
                    ticket = await run_db(ondemand.request_load, model, batch)  # parked meanwhile: refused now
                    asked = time.perf_counter()
                left = deadline - time.perf_counter()
                if left <= 0:
                    retry = max(1, math.ceil(ticket.expected_seconds - (time.perf_counter() - asked)))
                    details = {"model": model, "expected_seconds": retry}
                    if ticket.coming_back:
                        details["reason"] = ticket.coming_back
                        message = f"{model} is coming back ({ticket.coming_back}); retry in about {retry} s."
                    else:
                        message = f"{model} is loading; retry in about {retry} s."
                    error = ModelLoading(message, details=details)
                    error.headers = [(b"retry-after", str(retry).encode())]
                    raise error
                await asyncio.sleep(min(0.25, left))
        finally:
            queued.pop(id(call), None)
            metrics.WAITING.labels(model).dec()
            call.queue_ms = round((time.perf_counter() - began) * 1000, 3)
            metrics.QUEUE.labels(model).observe(call.queue_ms / 1000)

    async def _forward(self, call: Call, route: routing.ModelRoute, upstream_path: str, body: bytes) -> None:
        tried = None
        for attempt in (0, 1):
            endpoint = self.balancer.pick(route.endpoints, exclude=tried)
            if endpoint is None:
                raise NoReplica(f"No replica of {route.name} can be reached.", details={"model": route.name})
            call.replica_id = endpoint.replica_id
            headers = {"Authorization": "Bearer " + endpoint.key, "Content-Type": "application/json",
                       "X-Request-Id": call.request_id}
            upstream = call.span
            if upstream.recording:
                upstream = upstream.child("upstream", tracing.CLIENT, **{
                    "berth.replica_id": endpoint.replica_id, "berth.attempt": attempt,
                    "url.full": endpoint.url + upstream_path})
            # The engine hears the trace: this attempt as its parent, or, untraced here, the client's own.
            traceparent = upstream.traceparent or (call.traceparent if tracing.parse_traceparent(call.traceparent)
                                                   else None)
            if traceparent:
                headers["traceparent"] = traceparent
            self.balancer.begin(endpoint)
            try:
                try:
                    response = await self.session.post(endpoint.url + upstream_path, data=body, headers=headers,
                                                       timeout=self.timeout)
                    upstream.set("http.response.status_code", response.status)
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as exc:
                    upstream.error(f"unreachable: {exc.__class__.__name__}")
                    self.balancer.failed(endpoint)
                    tried = endpoint.replica_id
                    if attempt == 0 and self.balancer.available(route.endpoints, exclude=tried):
                        log.info("request %s: replica %s unreachable (%s); retrying on another",
                                 call.request_id, endpoint.replica_id, exc.__class__.__name__)
                        continue
                    raise UpstreamError(f"Could not reach a replica of {route.name}.",
                                        details={"model": route.name}) from None
                except asyncio.TimeoutError:
                    upstream.error("timeout")
                    raise UpstreamTimeout(f"{route.name} did not answer in time.") from None
                self.balancer.succeeded(endpoint)
                try:
                    if call.stream and response.status == 200:
                        await self._relay_stream(call, response)
                    else:
                        await self._relay_whole(call, response, route)
                finally:
                    if call.finished and not call.disconnected:
                        response.release()
                    else:
                        response.close()  # closes the engine's connection: it stops generating
            finally:
                self.balancer.end(endpoint)
                upstream.end()
            return

    async def _forward_line(self, call: Call, route: routing.ModelRoute, upstream_path: str, body: bytes) -> None:
        """A batch's line: claimed just before an engine hears it (never sent twice), its claim given
        back when no engine ran it (sent again later); its answer is kept as it is answered."""
        if not await run_db(lines.claim, call.batch, call.request_id):
            raise BatchLineTaken("This line of the batch was already sent, or its batch is not running.",
                                 details={"batch": call.batch.batch, "index": call.batch.index})
        try:
            await self._forward(call, route, upstream_path, body)
        except BerthError as error:
            if error.code in lines.NOT_SENT:
                await run_db(lines.give_back, call.batch)
            raise

    async def _relay_whole(self, call: Call, response: aiohttp.ClientResponse, route: routing.ModelRoute) -> None:
        try:
            data = await response.read()
        except asyncio.TimeoutError:
            raise UpstreamTimeout("The engine did not finish in time.") from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError):
            raise UpstreamError("The engine's connection broke before it answered.") from None
        status = response.status
        if status < 300:
            if call.endpoint in COUNTING:  # no model ran: a request for the rate limits, no tokens for budgets
                call.prompt_tokens = call.completion_tokens = 0
            else:
                _usage_from(data, call)
            await call.respond(status, data)
            return
        if status in (400, 413, 422):
            try:
                parsed = orjson.loads(data)
            except orjson.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                error = parsed["error"]
                call.error_code = str(error.get("code") or error.get("type") or "")[:64]
                if call.endpoint in ANTHROPIC and parsed.get("type") != "error":  # llama.cpp answers in OpenAI's
                    data = orjson.dumps({"type": "error", "error": {
                        "type": ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error"),
                        "message": str(error.get("message") or "The engine refused the request.")}})
                await call.respond(status, data)
                return
            raise BerthError("The engine refused the request.", code="invalid_request", status=status)
        if status == 404:  # an engine (of a version not known to ``gateway.routes``) without this route
            name = routes.engine_name(route, call.replica_id) or "its engine"
            raise RouteNotServed(f"{call.model_label} runs on {name}, which does not serve {call.path}.",
                                 details={"model": call.model_label, "engine": [name], "endpoint": call.path})
        if status == 503:
            error = ModelLoading("The engine is busy or still loading; retry shortly.")
            error.headers = [(b"retry-after", b"1")]
            raise error
        raise UpstreamError(f"The engine answered with status {status}.", details={"upstream_status": status})

    async def _relay_stream(self, call: Call, response: aiohttp.ClientResponse) -> None:
        headers = [(b"x-request-id", call.rid_bytes), (b"content-type", b"text/event-stream"),
                   (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        if call.extra_headers:
            headers += call.extra_headers
        call.status = 200
        call.response_started = True
        send = call.send
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tail = b""
        end = STREAM_END.get(call.endpoint, b"data: [DONE]")
        try:
            async for chunk in response.content.iter_any():
                if call.ttft_ms is None:
                    call.ttft_ms = round((time.perf_counter() - call.started) * 1000, 3)
                window = tail + chunk if tail else chunk
                if b'"usage"' in window or b"_tokens" in window:
                    _usage_from(window, call)
                if end in window:
                    call.saw_done = True
                tail = window[-600:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError, asyncio.TimeoutError
                ) as exc:
            timed_out = isinstance(exc, asyncio.TimeoutError)
            error = (UpstreamTimeout("The engine stopped sending in time.") if timed_out
                     else UpstreamError("The engine's connection broke mid-stream; the answer is incomplete."))
            call.status, call.error_code = error.status, error.code
            call.finished = True
            await send({"type": "http.response.body", "body": stream_error(call.endpoint, error), "more_body": False})
            return
        call.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- after the answer ----------------------------------------------------------------------

    def _record(self, call: Call) -> None:
        finished_wall = time.time()
        total_ms = round((time.perf_counter() - call.started) * 1000, 3)
        principal = call.principal
        line = {"request_id": call.request_id, "method": call.method, "path": call.path, "status": call.status,
                "model_asked": call.model_asked, "model_served": call.model_label if call.replica_id else "",
                "replica": call.replica_id, "queue_ms": call.queue_ms, "ttft_ms": call.ttft_ms, "total_ms": total_ms,
                "prompt_tokens": call.prompt_tokens, "completion_tokens": call.completion_tokens,
                "key": principal.key_prefix if principal else None,
                "client": principal.client_id if principal else None,
                "project": principal.project_path if principal else None, "error": call.error_code or None}
        row = None
        if principal is not None and call.endpoint and call.endpoint != "models":
            row = {"request_id": call.request_id, "started_at": call.started_wall, "finished_at": finished_wall,
                   "endpoint": call.endpoint, "stream": call.stream, "model_asked": call.model_asked,
                   "model_served": line["model_served"], "replica_id": call.replica_id, "status": call.status,
                   "error_code": call.error_code, "queue_ms": call.queue_ms, "ttft_ms": call.ttft_ms,
                   "total_ms": total_ms, "prompt_tokens": call.prompt_tokens,
                   "completion_tokens": call.completion_tokens, "credential_id": principal.credential_pk,
                   "key_prefix": principal.key_prefix, "client_id": principal.client_pk,
                   "project_id": principal.project_pk, "scope_path": principal.project_path}
        self.recorder.add(row, line)
        if call.endpoint:
            label = call.model_label
            metrics.REQUESTS.labels(label, call.endpoint, str(call.status)).inc()
            metrics.LATENCY.labels(label, call.endpoint).observe(total_ms / 1000)
            if call.ttft_ms is not None:
                metrics.TTFT.labels(label).observe(call.ttft_ms / 1000)
            if call.prompt_tokens:
                metrics.TOKENS.labels(label, "prompt").inc(call.prompt_tokens)
            if call.completion_tokens:
                metrics.TOKENS.labels(label, "completion").inc(call.completion_tokens)


gateway = Gateway()
