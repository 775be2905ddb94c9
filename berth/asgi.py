import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "berth.settings")

django_application = get_asgi_application()

# The inference gateway (/v1/, and its /metrics) is a lean ASGI app of its own: Django's request
# path would cost more than the gateway's whole budget. Everything else is Django, the Batch API's
# files and batches included (uploads are multipart, and none of it is on the hot path).
from gateway.app import gateway  # noqa: E402 - needs the settings configured above

BATCH_API = ("/v1/files", "/v1/batches")


async def application(scope, receive, send):
    kind = scope["type"]
    if (kind == "http" and (scope["path"].startswith("/v1/") or scope["path"] == "/metrics")
            and not scope["path"].startswith(BATCH_API)):
        await gateway(scope, receive, send)
    elif kind == "lifespan":
        await _lifespan(receive, send)
    else:
        await django_application(scope, receive, send)


async def _lifespan(receive, send):
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await gateway.startup()
            except Exception as exc:  # noqa: BLE001 - reported to the server, which refuses to start
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await gateway.shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
