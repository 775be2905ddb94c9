"""The Redis limiter's scripts on a driven clock: windows, boundaries, settlements and leases at the
times the test chooses, against a real Redis, without waiting for any of them.

In production the scripts read Redis's ``TIME``; here ``Limiter(redis, lease, clock=...)`` hands them
the test's time instead (what ``LocalLimiter`` takes too, see test_local_limiter.py).
"""

import asyncio
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from gateway.errors import ConcurrencyLimited, RateLimited
from gateway.limits import Level, Limiter, Plan

BOUNDARY = 1_700_000_040.0  # a minute boundary


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def headers_of(admission_or_error) -> dict:
    return {k.decode(): v.decode() for k, v in admission_or_error.headers}


@pytest.fixture
def ident():
    """A fresh name for one test's counters, which are deleted from Redis afterwards."""
    if not settings.REDIS_URL:
        pytest.fail("these tests drive the Redis limiter: set REDIS_URL (the embedded mode has no Redis)")
    ident = uuid.uuid4().hex
    yield ident
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(f"berth:gw:*{ident}*"):
        client.delete(key)
    client.close()


def plan(ident, **levels) -> Plan:
    return Plan.build([Level("client", f"client:{ident}", levels.get("rpm"), levels.get("tpm"),
                             levels.get("concurrency"))], [])


def run(steps, clock, count=1, lease_seconds=60):
    """``steps(*limiters)`` (a coroutine function) with ``count`` Limiters, each on its own Redis
    connection (as separate gateway processes are), all on one driven ``clock``."""

    async def main():
        connections = [aioredis.Redis.from_url(settings.REDIS_URL) for _ in range(count)]
        try:
            return await steps(*(Limiter(c, lease_seconds=lease_seconds, clock=clock) for c in connections))
        finally:
            for connection in connections:
                await connection.aclose()

    return asyncio.run(main())


async def admitted(limiter, p, request_id="r") -> bool:
    try:
        await limiter.admit(p, request_id)
    except RateLimited:
        return False
    return True


def test_requests_per_minute_refuse_with_retry_after_and_slide(ident):
    clock = Clock(BOUNDARY + 20)
    p = plan(ident, rpm=3)

    async def steps(limiter):
        for remaining in (2, 1, 0):
            assert headers_of(await limiter.admit(p, "r"))["x-ratelimit-remaining-requests"] == str(remaining)
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(p, "r")
        assert int(headers_of(refused.value)["retry-after"]) >= 1
        assert headers_of(refused.value)["x-ratelimit-remaining-requests"] == "0"
        # Next minute, 30 s in: the previous bucket still weighs half of 3 = 1.5, so one more fits, not two.
        clock.now += 70
        assert await admitted(limiter, p) and not await admitted(limiter, p)
        clock.now += 120  # two minutes on, the window is empty again
        assert await admitted(limiter, p)

    run(steps, clock)


def test_a_burst_straddling_a_minute_boundary_admits_exactly_the_limit(ident):
    """Why the gateway's own burst tests need not keep away from a boundary: the sliding window
    weighs the bucket just ended almost fully, so a quick burst across it counts as one."""
    clock = Clock(BOUNDARY + 59.7)
    p = plan(ident, rpm=8)

    async def steps(limiter):
        before = [await admitted(limiter, p) for _ in range(5)]
        clock.now = BOUNDARY + 60.4  # the next bucket
        after = [await admitted(limiter, p) for _ in range(15)]
        return before, after

    before, after = run(steps, clock)
    assert before == [True] * 5
    assert after.count(True) == 3 and after[:3] == [True] * 3


def test_two_limiters_on_one_redis_share_the_limit(ident):
    clock = Clock(BOUNDARY + 10)
    p = plan(ident, rpm=8)

    async def steps(first, second):
        return await asyncio.gather(*(admitted(limiter, p, f"r{n}") for n in range(10) for limiter in (first, second)))

    outcomes = run(steps, clock, count=2)
    assert outcomes.count(True) == 8 and outcomes.count(False) == 12


def test_tokens_are_charged_in_the_minute_of_the_driven_clock(ident):
    clock = Clock(BOUNDARY + 5)
    p = plan(ident, tpm=100)

    async def steps(limiter):
        await limiter.admit(p, "a")
        limiter.settle(p, "a", 60)
        await limiter.drain()
        remaining = headers_of(await limiter.admit(p, "b"))["x-ratelimit-remaining-tokens"]
        clock.now += 120  # the charge lies two buckets back: forgotten
        later = headers_of(await limiter.admit(p, "c"))["x-ratelimit-remaining-tokens"]
        return remaining, later

    assert run(steps, clock) == ("40", "100")


def test_a_concurrency_lease_that_never_settles_expires_on_the_driven_clock(ident):
    clock = Clock(BOUNDARY + 5)
    p = plan(ident, concurrency=1)

    async def steps(limiter):
        await limiter.admit(p, "a")  # never settled: a gateway that died mid-request
        with pytest.raises(ConcurrencyLimited):
            await limiter.admit(p, "b")
        clock.now += 31
        await limiter.admit(p, "b")

    run(steps, clock, lease_seconds=30)
