"""Live events other processes act on, published on Redis pub/sub.

Tenancy only publishes; whoever caches what tenancy owns (the gateway's in-process key cache)
subscribes. Publishing is best effort after commit: a lost message is covered by the subscriber's
cache lifetime, which is short.

A revocation is synchronous: every subscriber acknowledges each message once it has acted on it
(it publishes to the channel the message names, see ``received``: pub/sub, as Redis counts
receivers across its databases), and the publisher waits for as many acknowledgements as Redis
counted receivers, up to ``ACK_TIMEOUT_S``. So when revoking returns, no gateway process still
trusts the key — a request sent after it is refused, not merely one sent a moment later. A
subscriber that does not answer (stuck, gone) costs the wait and a warning.

Every event also reaches this process's own listeners (``listen_locally``) at once, Redis or not:
the embedded mode has no Redis (one process, which both revokes a key and serves it), and a
process need not wait for a round trip through Redis to learn what it did itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Iterable

from django.conf import settings
from django.db import transaction

# One message per key (its lookup): forget what you know of it — revoked, its expiry moved, its
# client deleted, disabled or changed. A subscriber drops the key and reads it again when used.
CREDENTIAL_REVOKED = "berth:tenancy:credential-revoked"

ACK_TIMEOUT_S = 2.0  # how long a publisher waits for every subscriber to confirm

log = logging.getLogger(__name__)


def received(message: str) -> tuple[str, str | None]:
    """(the event, the channel to publish an acknowledgement on once acted on, or None) of a
    message as a subscriber receives it."""
    event, _, ack = message.partition(" ")
    return event, ack or None


_local_listeners: list[Callable[[str, str], None]] = []


def listen_locally(callback: Callable[[str, str], None]) -> Callable[[], None]:
    """Call ``callback(channel, message)`` for every event published in this process, from the
    publishing thread, as soon as its transaction commits. Returns the function that stops it."""
    _local_listeners.append(callback)

    def stop() -> None:
        if callback in _local_listeners:
            _local_listeners.remove(callback)

    return stop


def _publish(channel: str, messages: list[str]) -> None:
    for callback in list(_local_listeners):
        for message in messages:
            try:
                callback(channel, message)
            except Exception:  # noqa: BLE001 - one listener's failure must not stop the others or Redis
                log.exception("a local listener of %s failed", channel)
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        return  # embedded mode: one process, told above
    import redis

    ack = f"{channel}:ack:{uuid.uuid4().hex}"
    try:
        client = redis.Redis.from_url(url, socket_timeout=ACK_TIMEOUT_S + 2)
        acks = client.pubsub()
        try:
            acks.subscribe(ack)
            deadline = time.monotonic() + ACK_TIMEOUT_S
            # Confirmed before publishing, so that no acknowledgement can come before it listens.
            while (left := deadline - time.monotonic()) > 0:
                confirmation = acks.get_message(timeout=left)
                if confirmation is not None and confirmation["type"] == "subscribe":
                    break
            expected = sum(client.publish(channel, f"{message} {ack}") for message in messages)
            heard = 0
            while heard < expected and (left := deadline - time.monotonic()) > 0:
                answer = acks.get_message(timeout=left)
                if answer is not None and answer["type"] == "message":
                    heard += 1
            if heard < expected:
                log.warning("%d of %d receivers of %s did not confirm within %.0f s", expected - heard, expected,
                            channel, ACK_TIMEOUT_S)
        finally:
            acks.close()
            client.close()
    except redis.RedisError as exc:
        log.warning("could not publish %s: %s", channel, exc)


def credentials_changed(lookups: Iterable[str]) -> None:
    """Announce, once the transaction commits, that what a process knows of the keys
    ``brk_<lookup>_…`` is stale (revoked, expiring sooner, or their client deleted or changed)."""
    lookups = [lookup for lookup in lookups if lookup]
    if lookups:
        transaction.on_commit(lambda: _publish(CREDENTIAL_REVOKED, lookups))


def credential_revoked(lookup: str) -> None:
    """Announce, once the transaction commits, that the key ``brk_<lookup>_…`` no longer works."""
    credentials_changed([lookup])
