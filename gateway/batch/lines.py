"""A batch's lines as the gateway sees them: whose they are, and sent at most once.

The worker running a batch (``gateway.batch.runner``) sends each line to the gateway's own /v1/ route
with ``x-berth-batch: <batch id>:<index>:<signature>`` instead of a key: the signature (an HMAC from
the secret key) says the worker sent it, and the line's requests are then the batch's key's — its
client's scopes, limits and budgets, its revocation — at the **batch** priority, whatever the client's
own. The gateway claims the line (pending → running, one conditional UPDATE) just before it sends it
to an engine and writes its answer before it answers the worker; a line already claimed is refused
(409 ``batch_line_taken``). So a worker that dies midway loses nothing: the gateway finishes what it
sent, and the next worker sends only lines still pending.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from gateway.models import Batch, BatchLine

HEADER = b"x-berth-batch"
RUNNABLE = (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING)
# Refusals after which the engine never ran the request: its claim is given back, and it is sent again later.
NOT_SENT = frozenset({"no_ready_replica", "model_loading"})
# Refusals of a request that reached no engine and may pass later: the worker waits and sends it again.
# ``no_idle_capacity``: the model it needs fits only by preempting, which a batch never does.
RETRY_LATER = NOT_SENT | frozenset({"rate_limit_exceeded", "concurrency_limit_exceeded", "queue_full",
                                    "server_busy", "limiter_unavailable", "database_unavailable",
                                    "no_idle_capacity"})
# Refusals of the batch's key itself: no line of it can run any more.
KEY_REFUSED = frozenset({"invalid_api_key", "api_key_revoked", "api_key_expired", "client_disabled"})


def _key() -> bytes:
    return hmac.new(settings.SECRET_KEY.encode(), b"berth batch lines", hashlib.sha256).digest()


def sign(public_id: str, index: int) -> str:
    message = f"{public_id}:{index}"
    return f"{message}:{hmac.new(_key(), message.encode(), hashlib.sha256).hexdigest()}"


@dataclasses.dataclass
class Line:
    """The line a request carries (from a signed header), and whether the gateway claimed it."""

    batch: str
    index: int
    claimed: bool = False


def verify(header: bytes) -> Line | None:
    """The line a signed header names, or None when the signature does not hold."""
    try:
        public_id, index, signature = header.decode("ascii").split(":")
        number = int(index)
    except (UnicodeDecodeError, ValueError):
        return None
    expected = hmac.new(_key(), f"{public_id}:{number}".encode(), hashlib.sha256).hexdigest()
    if number < 0 or not hmac.compare_digest(expected, signature):
        return None
    return Line(public_id, number)


def credential_of(public_id: str):
    """The key a batch runs as (with its client and project), checked usable. Database."""
    from tenancy.errors import InvalidApiKey
    from tenancy.services import clients

    batch = Batch.objects.select_related("credential__client__project").filter(public_id=public_id).first()
    if batch is None:
        raise InvalidApiKey("No such batch.")
    return clients.usable(batch.credential)


def claim(line: Line, request_id: str) -> bool:
    """pending → running for this request; False when it was already claimed (or its batch is not
    running: cancelled or expired lines are not sent)."""
    claimed = BatchLine.objects.filter(batch__public_id=line.batch, batch__status__in=RUNNABLE, index=line.index,
                                       state=BatchLine.State.PENDING).update(
        state=BatchLine.State.RUNNING, request_id=request_id, claimed_at=timezone.now())
    line.claimed = bool(claimed)
    return line.claimed


def give_back(line: Line) -> None:
    """running → pending: refused before an engine ran it (it is sent again later)."""
    BatchLine.objects.filter(batch__public_id=line.batch, index=line.index, state=BatchLine.State.RUNNING).update(
        state=BatchLine.State.PENDING, request_id="", claimed_at=None)
    line.claimed = False


def settle(line: Line, status: int, body: bytes, error_code: str = "") -> None:
    """The answer of a claimed line: done (2xx) or failed, with the body as answered."""
    finish(Q(batch__public_id=line.batch, index=line.index, state=BatchLine.State.RUNNING), status, body,
           error_code)


def finish(where: Q, status: int | None, body: bytes, error_code: str = "", message: str = "") -> int:
    """Lines matching ``where`` ended with this answer (or, with no status, this error)."""
    ok = status is not None and status < 300
    return BatchLine.objects.filter(where).update(
        state=BatchLine.State.DONE if ok else BatchLine.State.FAILED, status_code=status,
        response=body.decode("utf-8", "replace"), error_code="" if ok else error_code[:64],
        error_message=message, finished_at=timezone.now())
