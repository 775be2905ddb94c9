"""API keys: ``brk_<lookup>_<secret>``.

``lookup`` (12 hex characters) is unique and indexed; ``secret`` carries 32 random bytes. Only
HMAC-SHA256(pepper, secret) is stored; the pepper lives outside the database (settings), so a copy
of the database alone cannot mint or check keys.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from django.conf import settings

PREFIX = "brk_"
_KEY = re.compile(r"^brk_([0-9a-f]{12})_([A-Za-z0-9_-]{43,128})$")


def new_key() -> tuple[str, str, str]:
    """A fresh key: (plaintext, lookup, secret)."""
    lookup = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)  # 32 bytes -> 43 characters
    return f"{PREFIX}{lookup}_{secret}", lookup, secret


def parse(plaintext: str) -> tuple[str, str] | None:
    """(lookup, secret) of a well-formed key, else None."""
    match = _KEY.match(plaintext or "")
    return (match.group(1), match.group(2)) if match else None


def digest(secret: str) -> bytes:
    return hmac.new(settings.KEY_PEPPER.encode(), secret.encode(), hashlib.sha256).digest()


def matches(secret: str, stored: bytes) -> bool:
    return hmac.compare_digest(digest(secret), bytes(stored))
