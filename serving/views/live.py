"""Live deployment state for the console, as server-sent events.

Every transition is published on Redis (``serving.deployments.states.publish``); this streams the
ones of one deployment to a browser, which then reloads the deployment's live panel. Without Redis
(the embedded mode) there is nothing to listen to and the panel polls instead.
"""

from __future__ import annotations

import json
import time

from django.conf import settings

CHANNEL = "berth:deployments"
STREAM_SECONDS = 600  # then the browser's EventSource reconnects by itself
KEEPALIVE_SECONDS = 15


async def deployment_events(deployment_id: str, stream_seconds: float = STREAM_SECONDS):
    """Server-sent events for one deployment: each transition as ``event: state``."""
    import redis.asyncio as redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    pubsub = client.pubsub()
    await pubsub.subscribe(CHANNEL)
    deadline = time.monotonic() + stream_seconds
    try:
        yield "retry: 2000\n\n"
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=KEEPALIVE_SECONDS)
            if message is None:  # nothing yet (or a subscription notice): a comment now and then keeps proxies open
                if time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            event = json.loads(message["data"])
            if event.get("deployment") == deployment_id:
                quiet_since = time.monotonic()
                yield f"event: state\ndata: {json.dumps(event)}\n\n"
    finally:
        await pubsub.unsubscribe(CHANNEL)
        await pubsub.aclose()
        await client.aclose()
