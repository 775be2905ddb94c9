"""What serving tells other processes, best effort and after the commit: a replica's transition
(for the console's live panels) and "the routing table changed" (so every gateway reloads at once
instead of waiting for its TTL). Both go over Redis pub/sub; without Redis (the embedded mode, one
web process) there is no one to tell and the readers poll. A message lost to a Redis outage costs a
live update or a TTL's wait, never a record: the rows are already committed."""

from __future__ import annotations

import json
import logging

from django.conf import settings
from django.utils import timezone

log = logging.getLogger(__name__)
ROUTING_CHANNEL = "berth:routing:changed"
DEPLOYMENTS_CHANNEL = "berth:deployments"
TIMEOUT_S = 1.0  # a stalled Redis must not hold up the caller's transition for longer than this


def publish(channel: str, message: bytes | str) -> None:
    """Publish now, best effort (a lost message is logged, not raised)."""
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        return
    import redis  # only where Redis is configured: the embedded mode never loads the client

    try:
        client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        try:
            client.publish(channel, message)
        finally:
            client.close()
    except redis.RedisError as error:
        log.warning("could not publish on %s: %s", channel, error)


def routing_changed() -> None:
    """Tell every gateway process to reload its routing table now (callers hand this to
    ``transaction.on_commit``, so gateways never reload before the change is visible)."""
    publish(ROUTING_CHANNEL, b"1")


def replica_moved(deployment_id: str, replica_id: str, origin: str, to: str, message: str) -> None:
    """A replica's transition, for the console's live panel of its deployment (call after the commit)."""
    publish(DEPLOYMENTS_CHANNEL, json.dumps({"deployment": deployment_id, "replica": replica_id, "from": origin,
                                             "to": to, "message": message, "at": timezone.now().isoformat()}))
