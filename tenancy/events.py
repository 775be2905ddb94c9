"""Live events other processes act on, published on Redis pub/sub.

Tenancy only publishes; whoever caches what tenancy owns (the gateway's in-process key cache)
subscribes. Publishing is best effort after commit: a lost message is covered by the subscriber's
cache lifetime, which is short.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

CREDENTIAL_REVOKED = "berth:tenancy:credential-revoked"

log = logging.getLogger(__name__)


def _publish(channel: str, message: str) -> None:
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        return  # embedded mode: one process, its cache lifetime is the window
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:
            client.publish(channel, message)
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("could not publish %s: %s", channel, exc)


def credential_revoked(lookup: str) -> None:
    """Announce, once the transaction commits, that the key ``brk_<lookup>_…`` no longer works."""
    transaction.on_commit(lambda: _publish(CREDENTIAL_REVOKED, lookup))
