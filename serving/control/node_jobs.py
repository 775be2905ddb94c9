"""Leased jobs for the nodes' agents: the queue of work a node claims through the node API.

A job is a row (``serving.models.NodeJob``). The control side queues it (``serving.queues.enqueue``,
idempotent on its key); the node long-polls for it (``claim``), most urgent first — maintenance
(stop, sleep, watch) before lifecycle (start, wake) before bulk work (fetching weights, probes), then
oldest first — and receives a lease token of which only the SHA-256 is kept. While it works it extends
the lease (``extend``) and may report what it sees (``report``); it ends the job with ``complete``
or ``fail``. Every one of those calls carries the lease: a lease that is not the job's current one
(the job was handed to another claim since, it expired, or the job is finished) is refused with
409 ``node_lease_stale`` and changes nothing. A lease that runs out (``expire_leases``, every
10 s from beat, and at each claim of its node) returns the job to the queue, or fails it once its attempts are spent. A job of
another node is refused with 403 ``node_ownership_mismatch`` and audited.

What a job *means* is its kind's handler's (``register``): the serving module that owns a kind
says whether a queued job may be handed out now (``claimable``), what the node receives with it at
its claim (``claimed``: extra payload, e.g. an engine's key, which is never stored), and what a
report, a completion and a failure do (``report``, ``complete``, ``fail``, each in the same
transaction as the job's own change). Handlers register at import, from the app's ``ready``.

Claims are taken, not checked then acted on: candidates are read ``FOR UPDATE SKIP LOCKED`` (two
claimers on PostgreSQL never wait on, or take, the same row) and the lease is sealed by an update
conditional on the job still being queued, whose row count decides; every later call is an update
conditional on the lease it presents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import redis
from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from berth.errors import Conflict, InvalidInput, NotFound
from scheduler.api.node_auth import refuse_foreign
from serving import queues
from serving.models import NodeJob

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often a waiting claim looks again for work queued by another process (no Redis)
REDIS_LOOK_SECONDS = 1.0  # with Redis, announcements wake a claim; this look covers one that was lost
MAX_CLAIM_SECONDS = 60  # no claim waits longer (the API allows 30 s)
LEASE_PREFIX = "bnl_"


class NodeJobNotFound(NotFound):
    code = "node_job_not_found"


class NodeLeaseStale(Conflict):
    """The lease presented is not the job's current one: expired, handed to another claim since, or
    the job is finished. Nothing was changed."""

    code = "node_lease_stale"


class UnknownReport(InvalidInput):
    """A report a job of its kind does not make (a handler raises it; so does a kind that takes none)."""

    code = "unknown_node_report"


@dataclasses.dataclass(frozen=True)
class Handler:
    complete: Callable[[NodeJob, dict], dict | None]
    fail: Callable[[NodeJob, str, dict], dict | None]
    report: Callable[[NodeJob, str, dict], dict | None] | None = None
    claimable: Callable[[NodeJob], bool] | None = None
    claimed: Callable[[NodeJob], Any] | None = None


# The registry: kind -> its handler (``register``). Tests that add a kind restore it after.
HANDLERS: dict[str, Handler] = {}


def register(kind: str, *, complete, fail, report=None, claimable=None, claimed=None) -> None:
    """Say what a job of ``kind`` means (see the module's docstring). A kind registered again is
    replaced (a module imported twice, a test's stand-in).

    - ``claimable(job) -> bool``: may the queued job be handed out now (False holds it back)?
    - ``claimed(job) -> dict | None``: at its claim, what the node receives on top of the stored
      payload (not stored); None cancels the job instead (it is moot now).
    - ``report(job, event, data) -> dict``, ``complete(job, result) -> dict``,
      ``fail(job, error, details) -> dict``: their answer is the node's.
    """
    HANDLERS[kind] = Handler(complete=complete, fail=fail, report=report, claimable=claimable, claimed=claimed)


def _handler(kind: str) -> Handler:
    try:
        return HANDLERS[kind]
    except KeyError:
        raise LookupError(f"no handler is registered for node jobs of kind {kind!r}") from None


# -- queueing ------------------------------------------------------------------------------------

# Claims waiting in this process hear of a job queued by it at once (``queues.enqueue`` notifies);
# those of other processes find it at their next look (POLL_SECONDS).
_queued = queues.node_job_queued


def enqueue(node, kind: str, *, key: str, replica=None, payload: dict | None = None, priority: int | None = None,
            available_at=None, max_attempts: int = 3) -> NodeJob:
    """``queues.enqueue``, for a kind someone handles: a kind nobody handles is a bug of the caller,
    said now rather than at its claim."""
    _handler(kind)
    return queues.enqueue(node, kind, key=key, replica=replica, payload=payload, priority=priority,
                          available_at=available_at, max_attempts=max_attempts)


def request_cancel(job: NodeJob) -> NodeJob:
    """Ask for ``job`` to stop: a queued one is cancelled at once; a leased one is told so when its
    node next extends the lease (the node decides how to stop, and still completes or fails it)."""
    now = timezone.now()
    NodeJob.objects.filter(pk=job.pk, state=NodeJob.State.QUEUED).update(state=NodeJob.State.CANCELLED,
                                                                        cancel_requested=True, finished_at=now)
    NodeJob.objects.filter(pk=job.pk, state=NodeJob.State.LEASED).update(cancel_requested=True)
    job.refresh_from_db()
    return job


def cancel_pending(replica, kinds) -> int:
    """Cancel the queued (not yet claimed) jobs of these kinds for ``replica``; how many were."""
    return NodeJob.objects.filter(replica=replica, kind__in=list(kinds), state=NodeJob.State.QUEUED).update(
        state=NodeJob.State.CANCELLED, cancel_requested=True, finished_at=timezone.now())


# -- claiming ------------------------------------------------------------------------------------

def _digest(lease) -> str:
    return hashlib.sha256(lease.encode()).hexdigest() if isinstance(lease, str) else ""


def _claimable(node):
    now = timezone.now()
    return (NodeJob.objects.filter(node=node, state=NodeJob.State.QUEUED)
            .filter(Q(available_at__isnull=True) | Q(available_at__lte=now))
            .order_by("priority", "created_at", "pk"))


def claim(node, *, wait_seconds: float, agent: str = "") -> tuple[NodeJob, str] | None:
    """The node's most urgent claimable job, leased to it: (the job, the lease token). Waits up to
    ``wait_seconds`` for one to be queued (a long poll), then None. ``agent``: the claiming agent's
    instance; a claim of an agent the node has since restarted ends with nothing (a poll its dead
    agent left waiting must not take a job nobody will do). Leases of the node's that ran out are
    returned first, so no job waits on beat's sweep.

    The job returned carries in ``payload`` what its handler's ``claimed`` added, which the table does
    not keep (an engine's key travels with the claim only): never save it."""
    deadline = time.monotonic() + max(0.0, float(wait_seconds))
    expire_leases(node)
    with _announcements(node) as wait:
        while True:
            if agent and superseded(node, agent):
                return None
            claimed = _claim_once(node)
            if claimed is not None:
                return claimed
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait(left)


@contextlib.contextmanager
def _announcements(node):
    """``wait(seconds)``: until a job for ``node`` is announced, or the next look is due. With Redis,
    announcements come over pub/sub (subscribed before the first look, so none is missed), and a look
    every ``REDIS_LOOK_SECONDS`` covers one lost; without it, this process's own are heard at once
    and other processes' at the next look (``POLL_SECONDS``)."""
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        def wait(left: float) -> None:
            with _queued:
                _queued.wait(min(POLL_SECONDS, left))

        yield wait
        return
    client = redis.Redis.from_url(url, socket_timeout=MAX_CLAIM_SECONDS, socket_connect_timeout=2)
    subscription = client.pubsub(ignore_subscribe_messages=True)
    try:
        subscription.subscribe(queues.node_jobs_channel(node.pk))
    except redis.RedisError as error:  # Redis away: looked at as without it
        log.warning("node jobs: no announcements for %s (%s); looking every %ss", node.name, error, POLL_SECONDS)
        subscription = None

    def wait(left: float) -> None:
        if subscription is None:
            time.sleep(min(POLL_SECONDS, left))
            return
        try:
            subscription.get_message(timeout=min(REDIS_LOOK_SECONDS, left))
        except redis.RedisError:
            time.sleep(min(POLL_SECONDS, left))

    try:
        yield wait
    finally:
        try:
            if subscription is not None:
                subscription.close()
        finally:
            client.close()


def _claim_once(node) -> tuple[NodeJob, str] | None:
    if not _claimable(node).exists():  # the common answer of a long poll, without a transaction
        return None
    held_back: list[int] = []
    with transaction.atomic():
        while True:
            job = _claimable(node).exclude(pk__in=held_back).select_for_update(skip_locked=True).first()
            if job is None:
                return None
            handler = HANDLERS.get(job.kind)
            if handler is None:  # queued before a release that dropped its kind: nobody can do it
                _settle(job, NodeJob.State.FAILED, error=f"no handler for node jobs of kind {job.kind!r}")
                continue
            if handler.claimable is not None and not handler.claimable(job):
                held_back.append(job.pk)
                continue
            lease = _seal(job)
            if lease is None:
                continue  # taken by another claim between the read and the update
            extra = handler.claimed(job) if handler.claimed is not None else {}
            if extra is None:  # moot now (say, the replica stopped before its start came)
                _settle(job, NodeJob.State.CANCELLED, expect=NodeJob.State.LEASED)
                continue
            if extra:
                job.payload = {**job.payload, **extra}  # for the node, not the table
            return job, lease


def _seal(job: NodeJob) -> str | None:
    """Lease the queued ``job`` to its claim: the update's row count decides who holds it."""
    lease = LEASE_PREFIX + secrets.token_urlsafe(32)
    now = timezone.now()
    sealed = {"state": NodeJob.State.LEASED, "lease_digest": _digest(lease), "leased_at": now,
              "lease_expires_at": now + timedelta(seconds=settings.SERVING_NODE_LEASE_SECONDS)}
    if not NodeJob.objects.filter(pk=job.pk, state=NodeJob.State.QUEUED).update(attempts=F("attempts") + 1,
                                                                                 **sealed):
        return None
    # The claim holds the row's lock (select_for_update): what it read is the row, one attempt on.
    for name, value in sealed.items():
        setattr(job, name, value)
    job.attempts += 1
    return lease


def _settle(job: NodeJob, state: str, *, expect: str = NodeJob.State.QUEUED, error: str = "",
            result: dict | None = None) -> bool:
    """Finish ``job`` (done, failed or cancelled) if it is still ``expect``; whether it was."""
    fields = {"state": state, "finished_at": timezone.now(), "lease_digest": ""}
    if error:
        fields["error"] = error
    if result is not None:
        fields["result"] = result
    settled = NodeJob.objects.filter(pk=job.pk, state=expect).update(**fields)
    if settled:
        for name, value in fields.items():
            setattr(job, name, value)
    return bool(settled)


# -- the node's calls on a job it holds --------------------------------------------------------------

def _job_of(node, job_id, what: str) -> NodeJob:
    """``node``'s job ``job_id``: 404 when there is none, 403 (audited) when it is another node's."""
    try:
        public_id = job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(str(job_id))
    except ValueError:
        raise NodeJobNotFound("No such job.", details={"job": str(job_id)}) from None
    job = NodeJob.objects.filter(public_id=public_id).first()
    if job is None:
        raise NodeJobNotFound("No such job.", details={"job": str(public_id)})
    if job.node_id != node.pk:
        refuse_foreign(node, what, job)  # raises NodeOwnershipMismatch, with its audit event kept
    return job


def _stale(job: NodeJob) -> NodeLeaseStale:
    job.refresh_from_db(fields=["state"])
    return NodeLeaseStale("This lease is not the job's current one (it expired, the job was handed out again, "
                          "or it is finished): stop working on it.",
                          details={"job": str(job.public_id), "state": job.state})


def _held(job: NodeJob, lease):
    """The rows of ``job`` held under ``lease`` now: leased, with this lease, not expired."""
    digest = _digest(lease)
    if not digest or not hmac.compare_digest(digest, job.lease_digest or ""):
        return NodeJob.objects.none()
    return NodeJob.objects.filter(pk=job.pk, state=NodeJob.State.LEASED, lease_digest=digest,
                                  lease_expires_at__gt=timezone.now())


def extend(node, job_id, lease) -> NodeJob:
    """The lease's heartbeat: it runs ``SERVING_NODE_LEASE_SECONDS`` from now. The job returned says
    whether its cancellation was asked for (``cancel_requested``)."""
    job = _job_of(node, job_id, "extend the lease of job")
    expires = timezone.now() + timedelta(seconds=settings.SERVING_NODE_LEASE_SECONDS)
    if not _held(job, lease).update(lease_expires_at=expires):
        raise _stale(job)
    job.refresh_from_db()
    return job


def report(node, job_id, lease, event: str, data: dict | None) -> dict:
    """What the node sees while it works (``event`` with ``data``), for the kind's handler; its answer."""
    job = _job_of(node, job_id, "report on job")
    with transaction.atomic():
        current = _held(job, lease).select_for_update().first()
        if current is None:
            raise _stale(job)
        handler = _handler(current.kind)
        if handler.report is None:
            raise UnknownReport(f"A {current.kind} job makes no reports.", details={"event": event})
        return handler.report(current, event, data or {}) or {}


def complete(node, job_id, lease, result: dict | None) -> dict:
    """The job is done, with ``result``: recorded, then handed to its kind's ``complete`` in the same
    transaction; the handler's answer is the node's."""
    job = _job_of(node, job_id, "complete job")
    result = result or {}
    done = {"state": NodeJob.State.DONE, "result": result, "finished_at": timezone.now(), "lease_digest": ""}
    with transaction.atomic():
        if not _held(job, lease).update(**done):
            raise _stale(job)
        for name, value in done.items():  # the rest of the row is as read: a leased job's payload stays
            setattr(job, name, value)
        return _handler(job.kind).complete(job, result) or {}


def fail(node, job_id, lease, error: str, details: dict | None, retry: bool = False) -> dict:
    """The job failed (``error``, with ``details``). With ``retry`` and attempts left it is queued
    again (its handler hears nothing); else it is failed and its kind's ``fail`` answers."""
    job = _job_of(node, job_id, "fail job")
    details = details or {}
    error = str(error or "failed")[:10_000]
    with transaction.atomic():
        held = _held(job, lease)
        if retry and held.filter(attempts__lt=F("max_attempts")).update(
                state=NodeJob.State.QUEUED, error=error, lease_digest="", leased_at=None, lease_expires_at=None):
            return {"retried": True}
        if not held.update(state=NodeJob.State.FAILED, error=error, result={"details": details},
                           finished_at=timezone.now(), lease_digest=""):
            raise _stale(job)
        job.refresh_from_db()
        return _handler(job.kind).fail(job, error, details) or {}


# -- leases that ran out ---------------------------------------------------------------------------

def expire_leases(node=None) -> int:
    """Return every job (of ``node``, when given) whose lease ran out to the queue, or fail it (its
    kind's ``fail`` called) when its attempts are spent; how many were. Each in a transaction of its
    own, conditional on the lease read, so a lease extended or a job completed meanwhile is left alone."""
    now = timezone.now()
    expired = NodeJob.objects.filter(state=NodeJob.State.LEASED, lease_expires_at__lte=now)
    if node is not None:
        expired = expired.filter(node=node)
    count, nodes = 0, set()
    for job in expired.select_related("node").order_by("lease_expires_at"):
        lapsed = NodeJob.objects.filter(pk=job.pk, state=NodeJob.State.LEASED, lease_digest=job.lease_digest,
                                        lease_expires_at__lte=now)
        with transaction.atomic():
            if job.attempts < job.max_attempts:
                returned = lapsed.update(state=NodeJob.State.QUEUED, lease_digest="", leased_at=None,
                                         lease_expires_at=None, error=f"lease expired (attempt {job.attempts})")
                count += returned
                if returned:
                    nodes.add(job.node_id)
                continue
            error = (f"lease expired: {job.node.name} stopped extending it (attempt {job.attempts} "
                     f"of {job.max_attempts})")
            if not lapsed.update(state=NodeJob.State.FAILED, error=error, finished_at=now, lease_digest=""):
                continue
            count += 1
            job.refresh_from_db()
            handler = HANDLERS.get(job.kind)
            if handler is not None:
                handler.fail(job, error, {"reason": "lease_expired", "attempts": job.attempts})
    if count:
        log.info("node jobs: %d expired lease(s) returned to the queue or failed", count)
    for node_id in nodes:  # their claims look again at once
        transaction.on_commit(lambda node_id=node_id: queues.node_job_queued_for(node_id), robust=True)
    return count


def return_leases(node, why: str) -> int:
    """Every job ``node`` holds goes back to the queue now (its agent restarted: the leases died with
    the agent that held them); how many did. Their claims read the replica again, so a job that is
    moot by now is cancelled then."""
    returned = NodeJob.objects.filter(node=node, state=NodeJob.State.LEASED).update(
        state=NodeJob.State.QUEUED, lease_digest="", leased_at=None, lease_expires_at=None, error=why[:10_000])
    if returned:
        transaction.on_commit(lambda: queues.node_job_queued_for(node.pk), robust=True)
    return returned


# -- which agent is the node's -------------------------------------------------------------------

def _agent_key(node) -> str:
    return f"berth:node-agent:{node.pk}"


def note_agent(node, agent: str) -> None:
    """``agent`` (an instance id, new at each start) is the node's agent from now on: its first beat."""
    try:
        cache.set(_agent_key(node), agent, None)
    except Exception as error:  # noqa: BLE001 - the cache away: claims are not told apart meanwhile
        log.warning("%s: its agent's instance not noted (%s)", node.name, error)


def superseded(node, agent: str) -> bool:
    """Another instance of the node's agent started after ``agent`` (unknown: not superseded)."""
    try:
        current = cache.get(_agent_key(node))
    except Exception:  # noqa: BLE001 - the cache away: nothing to go by
        return False
    return current is not None and current != agent
