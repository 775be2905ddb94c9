"""The key cache while the database cannot be read, on a clock the test moves: a key read before answers
from its last reading for a bounded time, never past its own expiry nor after a revocation; a key
never read is 503 ``database_unavailable`` with Retry-After; the database is asked again at most once
a second per key. (tests/gateway/test_database_outage.py shows the same on a real gateway process.)"""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest
from django.db import OperationalError

from gateway import auth as gateway_auth
from gateway.errors import DatabaseUnavailable
from tenancy.errors import InvalidApiKey

TTL, STALE = 5, 60


@dataclasses.dataclass(frozen=True)
class _Loaded:
    lookup: str


class World:
    """A clock and a database the test controls (``down``), behind the cache's ``run_db``."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        self.down = False
        self.reads: list[str] = []
        self.expires_at: float | None = None  # as a Unix time, like a credential's
        monkeypatch.setattr(gateway_auth, "time", types.SimpleNamespace(monotonic=lambda: self.now,
                                                                        time=lambda: self.now))
        monkeypatch.setattr(gateway_auth, "run_db", self.run_db)

    async def run_db(self, fn, plaintext):
        self.reads.append(plaintext)
        if self.down:
            raise OperationalError("connection failed: Connection refused")
        if plaintext.endswith("wrong"):
            raise InvalidApiKey("Invalid API key.")
        return _Loaded(lookup=plaintext.split("_")[1]), self.expires_at


def ask(cache, key):
    return asyncio.run(cache.principal(key))


def test_a_key_read_before_answers_from_its_last_reading_for_the_stale_window_only(monkeypatch):
    world = World(monkeypatch)
    cache = gateway_auth.AuthCache(TTL, stale=STALE)
    assert ask(cache, "brk_abc_secret").lookup == "abc"
    world.down = True
    world.now += TTL + 1  # the reading expired: the database is asked, refuses
    assert ask(cache, "brk_abc_secret").lookup == "abc"
    world.now += STALE - 2  # still inside the window: STALE seconds past the reading's own expiry
    assert ask(cache, "brk_abc_secret").lookup == "abc"
    world.now += 2  # past it
    with pytest.raises(DatabaseUnavailable) as refused:
        ask(cache, "brk_abc_secret")
    assert refused.value.status == 503 and refused.value.code == "database_unavailable"
    assert dict(refused.value.headers)[b"retry-after"] == b"5"
    world.down = False
    assert ask(cache, "brk_abc_secret").lookup == "abc"  # back: read again


def test_a_key_never_read_gets_503_with_retry_after_and_a_refused_one_is_never_let_in(monkeypatch):
    world = World(monkeypatch)
    cache = gateway_auth.AuthCache(TTL, stale=STALE)
    with pytest.raises(InvalidApiKey):
        ask(cache, "brk_bad_wrong")
    world.down = True
    with pytest.raises(DatabaseUnavailable) as refused:
        ask(cache, "brk_new_secret")
    assert dict(refused.value.headers)[b"retry-after"] == b"5"
    with pytest.raises(InvalidApiKey):  # its refusal still holds for the cache's lifetime
        ask(cache, "brk_bad_wrong")
    world.now += TTL + 1
    with pytest.raises(DatabaseUnavailable):  # then it cannot be checked: a refusal is not kept for outages
        ask(cache, "brk_bad_wrong")


def test_a_key_is_never_served_past_its_own_expiry(monkeypatch):
    world = World(monkeypatch)
    world.expires_at = world.now + TTL + 3  # the key expires 3 s after its reading does
    cache = gateway_auth.AuthCache(TTL, stale=STALE)
    ask(cache, "brk_abc_secret")
    world.down = True
    world.now += TTL + 1
    assert ask(cache, "brk_abc_secret").lookup == "abc"
    world.now += 3
    with pytest.raises(DatabaseUnavailable):
        ask(cache, "brk_abc_secret")


def test_a_revocation_heard_during_the_outage_still_applies(monkeypatch):
    world = World(monkeypatch)
    cache = gateway_auth.AuthCache(TTL, stale=STALE)
    ask(cache, "brk_abc_secret")
    ask(cache, "brk_other_secret")
    world.down = True
    world.now += TTL + 1
    cache.drop_lookup("abc")  # the revocation arrives over Redis
    with pytest.raises(DatabaseUnavailable):
        ask(cache, "brk_abc_secret")
    assert ask(cache, "brk_other_secret").lookup == "other"  # another key rides on


def test_the_database_is_asked_at_most_once_a_second_per_key_during_the_outage(monkeypatch):
    world = World(monkeypatch)
    cache = gateway_auth.AuthCache(TTL, stale=STALE)
    ask(cache, "brk_abc_secret")
    world.down = True
    world.now += TTL + 1
    reads = len(world.reads)
    for _ in range(50):
        ask(cache, "brk_abc_secret")
    assert len(world.reads) == reads + 1
    world.now += gateway_auth.RETRY_SECONDS
    ask(cache, "brk_abc_secret")
    assert len(world.reads) == reads + 2


def test_with_no_stale_window_the_outage_is_a_503_not_a_500(monkeypatch):
    world = World(monkeypatch)
    cache = gateway_auth.AuthCache(TTL, stale=0)
    ask(cache, "brk_abc_secret")
    world.down = True
    world.now += TTL + 1
    with pytest.raises(DatabaseUnavailable):
        ask(cache, "brk_abc_secret")


def test_a_bug_is_not_dressed_up_as_an_outage(monkeypatch):
    World(monkeypatch)

    async def broken(fn, plaintext):
        raise KeyError("a bug")

    monkeypatch.setattr(gateway_auth, "run_db", broken)
    with pytest.raises(KeyError):  # the gateway logs it and answers 500: it is not the database's doing
        ask(gateway_auth.AuthCache(TTL, stale=STALE), "brk_abc_secret")
