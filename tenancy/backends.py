"""Password authentication with a bounded number of hashes in flight.

Argon2 takes ~100 MiB per hash by design. Unbounded, a login flood would run as many at once as
requests arrive and exhaust the machine's memory; here at most ``PASSWORD_HASH_SLOTS`` run per
process and a login that cannot get a slot in time is refused as busy (the caller retries).
"""

from __future__ import annotations

import threading

from django.conf import settings
from django.contrib.auth.backends import ModelBackend

from tenancy.errors import Busy

_slots: threading.BoundedSemaphore | None = None
_slots_lock = threading.Lock()
SLOT_WAIT_SECONDS = 10


def hashing_slots() -> threading.BoundedSemaphore:
    global _slots
    with _slots_lock:
        if _slots is None:
            _slots = threading.BoundedSemaphore(settings.PASSWORD_HASH_SLOTS)
        return _slots


class BoundedHashingBackend(ModelBackend):
    def authenticate(self, request, username=None, password=None, **kwargs):
        slots = hashing_slots()
        if not slots.acquire(timeout=SLOT_WAIT_SECONDS):
            raise Busy("Too many logins are being checked right now; try again in a few seconds.")
        try:
            return super().authenticate(request, username=username, password=password, **kwargs)
        finally:
            slots.release()
