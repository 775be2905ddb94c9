"""The web server's command line, one for production (``manage.py serve``, systemd) and the tests."""

from __future__ import annotations

import sys


def uvicorn_command(host: str, port: int, *extra: str) -> list[str]:
    """uvicorn serving Berth with the lifespan on: the gateway starts before the first request (it
    needs no Redis to start: it subscribes in the background) and, when the process is told to stop,
    flushes the usage it still buffers and lets the limiter give back its leases."""
    return [sys.executable, "-m", "uvicorn", "berth.asgi:application", "--host", host, "--port", str(port),
            "--lifespan", "on", "--timeout-graceful-shutdown", "5", "--no-server-header", *extra]
