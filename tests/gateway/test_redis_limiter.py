"""The Redis limiter's scripts on a driven clock: windows, boundaries, settlements and leases at the
times the test chooses, against a real Redis, without waiting for any of them. The window is exact:
no 60 s interval, wherever it starts, admits more than the limit (a flood slid across minute
boundaries shows it), and a request is admitted exactly while the tokens charged in the last 60 s
are under the tokens limit.

In production the scripts read Redis's ``TIME``; here ``Limiter(redis, lease, clock=...)`` hands them
the test's time instead (what ``LocalLimiter`` takes too, see test_local_limiter.py).
"""

import asyncio
import heapq
import math
import random
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


def most_in_any_minute(times_ms: list[int]) -> int:
    """The most of ``times_ms`` (ascending) that any 60 s interval holds, wherever it starts."""
    most, first = 0, 0
    for last, at in enumerate(times_ms):
        while times_ms[first] <= at - 60_000:
            first += 1
        most = max(most, last - first + 1)
    return most


def test_requests_per_minute_refuse_with_retry_after_and_slide(ident):
    clock = Clock(BOUNDARY + 20)
    p = plan(ident, rpm=3)

    async def steps(limiter):
        for remaining in (2, 1, 0):
            admission = headers_of(await limiter.admit(p, "r"))
            assert admission["x-ratelimit-remaining-requests"] == str(remaining)
            assert admission["x-ratelimit-reset-requests"] == "60s"  # the window is empty again 60 s on
        clock.now += 10
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(p, "r")
        # The three admitted at +20 leave the window at +80: 50 s from now, and not a moment before.
        assert headers_of(refused.value)["retry-after"] == "50"
        assert headers_of(refused.value)["x-ratelimit-remaining-requests"] == "0"
        assert headers_of(refused.value)["x-ratelimit-reset-requests"] == "50s"
        clock.now = BOUNDARY + 79.999  # in the next minute: a bucket estimate would admit here
        assert not await admitted(limiter, p)
        clock.now = BOUNDARY + 80
        assert [await admitted(limiter, p) for _ in range(4)] == [True, True, True, False]

    run(steps, clock)


def test_a_flood_across_minute_boundaries_never_passes_the_limit_in_any_60_s(ident):
    """The drill of issue 14: 60/min, a flood from second 52 of a minute. Two estimated buckets let
    112 through in one real 60 s window; the log lets exactly 60 through in every one, and uses
    all of them (180 in three minutes)."""
    clock = Clock(BOUNDARY - 8)
    p = plan(ident, rpm=60)

    async def steps(first, second):
        times = []
        for step in range(720):  # four attempts a second for three minutes, from two processes
            clock.now = BOUNDARY - 8 + step * 0.25
            if await admitted((first, second)[step % 2], p, f"r{step}"):
                times.append(round(clock.now * 1000))
        return times

    times = run(steps, clock, count=2)
    assert most_in_any_minute(times) == 60
    assert len(times) == 180


def test_bursts_at_random_times_never_pass_the_limit_in_any_60_s(ident):
    clock = Clock(BOUNDARY - 30)
    p = plan(ident, rpm=25)
    moments = random.Random(14)

    async def steps(first, second):
        times, now = [], BOUNDARY - 30
        for step in range(300):
            now += moments.choice((0, 0, 0.001, 0.4, 2.5, 9.0, 31.0))  # bursts, trickles and lulls
            clock.now = now
            limiter = (first, second)[moments.random() < 0.5]
            try:
                admission = await limiter.admit(p, f"r{step}")
            except RateLimited as refused:
                # Refused only when the window is full, and told when it is not.
                assert most_in_any_minute(times + [round(now * 1000)]) > 25
                wait = int(headers_of(refused)["retry-after"])
                oldest_out = (times[-25] + 60_000 - round(now * 1000)) / 1000
                assert wait == max(1, math.ceil(oldest_out))
                continue
            times.append(round(now * 1000))
            in_window = sum(1 for at in times if at > times[-1] - 60_000)
            assert headers_of(admission)["x-ratelimit-remaining-requests"] == str(25 - in_window)
        return times

    times = run(steps, clock, count=2)
    assert most_in_any_minute(times) == 25
    assert len(times) > 100  # the limit is used, not merely respected


def test_a_request_is_admitted_exactly_while_the_tokens_of_the_last_60_s_are_under_the_limit(ident):
    """Tokens are charged when each answer is in (settled at its own end, in any order); every
    admission is checked against what was charged in the 60 s before it, across boundaries."""
    clock = Clock(BOUNDARY - 50)
    p = plan(ident, tpm=1000)
    moments = random.Random(15)

    async def steps(first, second):
        charged: list[tuple[int, int]] = []  # (ms, tokens) as settled
        ends: list[tuple[float, int, int]] = []  # (when, request, tokens) still to settle
        outcomes, now = [], BOUNDARY - 50
        for step in range(400):
            now += moments.choice((0.05, 0.3, 1.0, 4.0))
            while ends and ends[0][0] <= now:  # the answers that came in meanwhile, in time order
                clock.now, request, tokens = heapq.heappop(ends)
                limiter = (first, second)[request % 2]
                limiter.settle(p, f"r{request}", tokens)
                await limiter.drain()
                charged.append((round(clock.now * 1000), tokens))
            clock.now = now
            at = round(now * 1000)
            in_window = sum(tokens for when, tokens in charged if when > at - 60_000)
            try:
                admission = await (first, second)[step % 2].admit(p, f"r{step}")
            except RateLimited as refused:
                assert refused.details["of"] == "tokens"
                outcomes.append((in_window, False))
                continue
            outcomes.append((in_window, True))
            assert headers_of(admission)["x-ratelimit-remaining-tokens"] == str(max(0, 1000 - in_window))
            heapq.heappush(ends, (now + moments.choice((0.0, 0.5, 3.0, 20.0)), step, moments.randint(1, 300)))
        return outcomes

    outcomes = run(steps, clock, count=2)
    assert all((in_window < 1000) == was_admitted for in_window, was_admitted in outcomes)
    assert sum(1 for _, was_admitted in outcomes if not was_admitted) > 20  # the limit was reached, often


def test_a_burst_straddling_a_minute_boundary_admits_exactly_the_limit(ident):
    """Why the gateway's own burst tests need not keep away from a boundary: the window slides, so a
    quick burst across it counts as one."""
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


def test_a_repeated_request_id_takes_a_lease_of_its_own(ident):
    """A caller chooses its X-Request-Id: sending one id with every request must not share one lease."""
    clock = Clock(BOUNDARY + 5)
    p = plan(ident, concurrency=2)

    async def steps(limiter):
        await limiter.admit(p, "same")
        await limiter.admit(p, "same")
        with pytest.raises(ConcurrencyLimited):
            await limiter.admit(p, "same")
        limiter.settle(p, "same", 0)  # one of them ends: one slot frees, the other stays held
        await limiter.drain()
        await limiter.admit(p, "same")
        with pytest.raises(ConcurrencyLimited):
            await limiter.admit(p, "same")

    run(steps, clock)


def test_admissions_asked_in_one_turn_go_in_one_pipeline_and_each_hears_its_own_answer(ident):
    clock = Clock(BOUNDARY + 5)

    async def steps(limiter):
        pipelines = []
        opened = limiter.redis.pipeline
        limiter.redis.pipeline = lambda *a, **kw: pipelines.append(1) or opened(*a, **kw)
        p = plan(ident, rpm=30)
        outcomes = await asyncio.gather(*(admitted(limiter, p, f"r{i}") for i in range(50)))
        first_burst = len(pipelines)
        await limiter.redis.script_flush()  # Redis restarted empty: the script is loaded again
        again = await asyncio.gather(*(admitted(limiter, p, f"s{i}") for i in range(5)))
        return outcomes, first_burst, again

    outcomes, first_burst, again = run(steps, clock)
    assert outcomes.count(True) == 30 and outcomes[:30] == [True] * 30  # in the order asked, exactly the limit
    assert first_burst == 1  # fifty admissions, one round trip
    assert again == [False] * 5  # answered (refused: the minute is full), not an error
