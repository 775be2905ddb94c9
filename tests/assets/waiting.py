"""Tests wait for a condition up to a deadline; they never sleep and hope."""

from __future__ import annotations

import time


def wait_until(condition, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll ``condition`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout:.0f}s")
        time.sleep(interval)
