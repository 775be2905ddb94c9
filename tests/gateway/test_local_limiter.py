"""The in-process limiter of the embedded mode (no Redis): the Lua script's semantics, in one process,
the exact window included (no 60 s interval admits more than the limit)."""

import asyncio
import heapq
import math
import random
import uuid
from datetime import datetime, timezone

import pytest
from django.test import override_settings

from gateway.errors import BudgetExceeded, ConcurrencyLimited, RateLimited
from gateway.limits import Budget, Level, Limiter, LocalLimiter, Plan, _end_of_period, _periods, period_bounds

START = 1_700_000_060.0  # 20 s into a minute (1_700_000_040 is a minute boundary)


class Clock:
    def __init__(self, now=START):
        self.now = now

    def __call__(self):
        return self.now


def plan(**levels):
    ident = uuid.uuid4().hex
    return Plan.build([Level("client", f"client:{ident}", levels.get("rpm"), levels.get("tpm"),
                             levels.get("concurrency"))],
                      [Budget(f"org{ident[:6]}", levels.get("daily"), levels.get("monthly"), levels.get("hard", True),
                              weekly=levels.get("weekly"))]
                      if levels.get("daily") or levels.get("weekly") or levels.get("monthly") else [])


def nothing_spent_before(path, since, until):
    """Budgets start from these usage records (none) where a test is not about rebuilding them."""
    return 0


def run(coroutine):
    return asyncio.run(coroutine)


def most_in_any_minute(times_ms: list[int]) -> int:
    """The most of ``times_ms`` (ascending) that any 60 s interval holds, wherever it starts."""
    most, first = 0, 0
    for last, at in enumerate(times_ms):
        while times_ms[first] <= at - 60_000:
            first += 1
        most = max(most, last - first + 1)
    return most


def headers_of(admission_or_error):
    return {k.decode(): v.decode() for k, v in admission_or_error.headers}


def test_requests_per_minute_refuse_with_retry_after_and_slide():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
    p = plan(rpm=3)
    for remaining in (2, 1, 0):
        admission = run(limiter.admit(p, "r"))
        assert headers_of(admission)["x-ratelimit-remaining-requests"] == str(remaining)
        assert headers_of(admission)["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(RateLimited) as refused:
        run(limiter.admit(p, "r"))
    headers = headers_of(refused.value)
    # The three admitted at START leave the window 60 s later, and not a moment before.
    assert refused.value.code == "rate_limit_exceeded" and headers["retry-after"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"] == "60s"
    clock.now = START + 59.999  # in the next minute: a bucket estimate would admit here
    with pytest.raises(RateLimited):
        run(limiter.admit(p, "r"))
    clock.now = START + 60
    for _ in range(3):
        run(limiter.admit(p, "r"))
    with pytest.raises(RateLimited):
        run(limiter.admit(p, "r"))


def test_a_flood_across_minute_boundaries_never_passes_the_limit_in_any_60_s():
    """As in test_redis_limiter.py: 60/min flooded from second 52 of a minute, 60 in every 60 s."""
    boundary = START - 20
    clock = Clock(boundary - 8)
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
    p = plan(rpm=60)
    times = []
    for step in range(720):
        clock.now = boundary - 8 + step * 0.25
        try:
            run(limiter.admit(p, f"r{step}"))
        except RateLimited:
            continue
        times.append(round(clock.now * 1000))
    assert most_in_any_minute(times) == 60 and len(times) == 180


def test_bursts_at_random_times_never_pass_the_limit_in_any_60_s():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
    p = plan(rpm=25)
    moments = random.Random(14)
    times, now = [], START
    for step in range(300):
        now += moments.choice((0, 0, 0.001, 0.4, 2.5, 9.0, 31.0))
        clock.now = now
        try:
            admission = run(limiter.admit(p, f"r{step}"))
        except RateLimited as refused:
            assert most_in_any_minute(times + [round(now * 1000)]) > 25
            oldest_out = (times[-25] + 60_000 - round(now * 1000)) / 1000
            assert int(headers_of(refused)["retry-after"]) == max(1, math.ceil(oldest_out))
            continue
        times.append(round(now * 1000))
        in_window = sum(1 for at in times if at > times[-1] - 60_000)
        assert headers_of(admission)["x-ratelimit-remaining-requests"] == str(25 - in_window)
    assert most_in_any_minute(times) == 25 and len(times) > 100


def test_a_request_is_admitted_exactly_while_the_tokens_of_the_last_60_s_are_under_the_limit():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
    p = plan(tpm=1000)
    moments = random.Random(15)
    charged, ends, outcomes, now = [], [], [], START
    for step in range(400):
        now += moments.choice((0.05, 0.3, 1.0, 4.0))
        while ends and ends[0][0] <= now:
            clock.now, request, tokens = heapq.heappop(ends)
            limiter.settle(p, f"r{request}", tokens)
            charged.append((round(clock.now * 1000), tokens))
        clock.now = now
        in_window = sum(tokens for when, tokens in charged if when > round(now * 1000) - 60_000)
        try:
            admission = run(limiter.admit(p, f"r{step}"))
        except RateLimited as refused:
            assert refused.details["of"] == "tokens"
            outcomes.append((in_window, False))
            continue
        outcomes.append((in_window, True))
        assert headers_of(admission)["x-ratelimit-remaining-tokens"] == str(max(0, 1000 - in_window))
        heapq.heappush(ends, (now + moments.choice((0.0, 0.5, 3.0, 20.0)), step, moments.randint(1, 300)))
    assert all((in_window < 1000) == was_admitted for in_window, was_admitted in outcomes)
    assert sum(1 for _, was_admitted in outcomes if not was_admitted) > 20


def test_a_repeated_request_id_takes_a_lease_of_its_own():
    limiter = LocalLimiter(lease_seconds=60, clock=Clock())
    p = plan(concurrency=2)
    run(limiter.admit(p, "same"))
    run(limiter.admit(p, "same"))
    with pytest.raises(ConcurrencyLimited):
        run(limiter.admit(p, "same"))
    limiter.settle(p, "same", 0)
    run(limiter.admit(p, "same"))
    with pytest.raises(ConcurrencyLimited):
        run(limiter.admit(p, "same"))


def test_tokens_per_minute_are_charged_on_settle():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
    p = plan(tpm=100)
    run(limiter.admit(p, "a"))
    limiter.settle(p, "a", 60)
    admission = run(limiter.admit(p, "b"))
    assert headers_of(admission)["x-ratelimit-remaining-tokens"] == "40"
    limiter.settle(p, "b", 50)
    with pytest.raises(RateLimited) as refused:
        run(limiter.admit(p, "c"))
    assert refused.value.details["of"] == "tokens"


def test_concurrency_leases_release_on_settle_and_expire():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=30, clock=clock)
    p = plan(concurrency=2)
    run(limiter.admit(p, "a"))
    run(limiter.admit(p, "b"))
    with pytest.raises(ConcurrencyLimited):
        run(limiter.admit(p, "c"))
    limiter.settle(p, "a", 0)
    run(limiter.admit(p, "c"))
    with pytest.raises(ConcurrencyLimited):
        run(limiter.admit(p, "d"))
    clock.now += 31  # a request that never settled (a crash) leaks nothing past its lease
    run(limiter.admit(p, "d"))


def test_hard_budget_refuses_until_the_next_day_and_soft_budget_warns():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=60, clock=clock, spent=nothing_spent_before)
    hard = plan(daily=100)
    run(limiter.admit(hard, "a"))
    limiter.settle(hard, "a", 100)
    with pytest.raises(BudgetExceeded) as refused:
        run(limiter.admit(hard, "b"))
    assert int(headers_of(refused.value)["retry-after"]) > 60
    clock.now += 86400
    run(limiter.admit(hard, "b"))

    soft = plan(monthly=10, hard=False)
    run(limiter.admit(soft, "a"))
    limiter.settle(soft, "a", 11)
    admission = run(limiter.admit(soft, "b"))
    assert admission.budget_warning


def test_hard_weekly_budget_refuses_until_monday_though_day_and_month_have_room():
    clock = Clock()  # START: Tuesday 2023-11-14 22:14:20 UTC, ISO week 46
    limiter = LocalLimiter(lease_seconds=60, clock=clock, spent=nothing_spent_before)
    p = plan(daily=1000, weekly=300, monthly=10_000)
    for day in range(3):  # 100 a day: Tuesday, Wednesday, Thursday
        clock.now = START + day * 86400
        run(limiter.admit(p, f"r{day}"))
        limiter.settle(p, f"r{day}", 100)
    with pytest.raises(BudgetExceeded) as refused:
        run(limiter.admit(p, "friday"))  # still Thursday: the day has 900 left, the month 9,700
    assert refused.value.details["period"] == "week" and "weekly token budget" in refused.value.message
    assert int(headers_of(refused.value)["retry-after"]) == 4 * 86400 - (22 * 3600 + 14 * 60 + 20)
    clock.now = START + 4 * 86400  # Saturday: the same week
    with pytest.raises(BudgetExceeded):
        run(limiter.admit(p, "saturday"))
    clock.now = datetime(2023, 11, 20, tzinfo=timezone.utc).timestamp()  # Monday 00:00: a new week
    run(limiter.admit(p, "monday"))


@pytest.mark.parametrize(("moment", "week", "start", "end"), [
    (datetime(2026, 3, 14, 15, 9), "202611", datetime(2026, 3, 9), datetime(2026, 3, 16)),
    (datetime(2026, 3, 16, 0, 0), "202612", datetime(2026, 3, 16), datetime(2026, 3, 23)),
    (datetime(2026, 1, 1, 12, 0), "202601", datetime(2025, 12, 29), datetime(2026, 1, 5)),  # ISO year 2026
    (datetime(2027, 1, 1, 12, 0), "202653", datetime(2026, 12, 28), datetime(2027, 1, 4)),
    (datetime(2021, 1, 3, 23, 59), "202053", datetime(2020, 12, 28), datetime(2021, 1, 4)),  # a 53-week year
])
def test_a_week_is_the_iso_week_from_monday_00_00_utc(moment, week, start, end):
    now = moment.replace(tzinfo=timezone.utc).timestamp()
    day, iso_week, month = _periods(now)
    assert (day, iso_week, month) == (moment.strftime("%Y%m%d"), week, moment.strftime("%Y%m"))
    assert period_bounds(week, "w") == (start.replace(tzinfo=timezone.utc), end.replace(tzinfo=timezone.utc))
    assert _end_of_period(now, "week") == end.replace(tzinfo=timezone.utc).timestamp() - now
    assert period_bounds(month, "m")[0] <= moment.replace(tzinfo=timezone.utc) < period_bounds(month, "m")[1]


def test_every_level_is_checked_and_none_charged_on_refusal():
    clock = Clock()
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
    ident = uuid.uuid4().hex
    roomy = Level("client", f"client:{ident}", 100, None, None)
    tight = Level("team", f"scope:t{ident[:8]}", 1, None, None)
    p = Plan.build([roomy, tight], [])
    admission = run(limiter.admit(p, "a"))
    assert headers_of(admission)["x-ratelimit-remaining-requests"] == "0"  # the level with least left
    with pytest.raises(RateLimited) as refused:
        run(limiter.admit(p, "b"))
    assert refused.value.details["level"] == "team"
    alone = Plan.build([roomy], [])
    assert headers_of(run(limiter.admit(alone, "c")))["x-ratelimit-remaining-requests"] == "98"


@pytest.mark.parametrize("levels", [{"rpm": 2}, {"concurrency": 1}, {"daily": 5}, {"tpm": 5, "rpm": 5},
                                    {"weekly": 5}, {"daily": 20, "weekly": 5, "monthly": 30},
                                    {"daily": 5, "weekly": 5, "monthly": 5}, {"daily": 8, "weekly": 50, "monthly": 5},
                                    {"weekly": 4, "hard": False}])
def test_same_answers_as_the_lua_script(levels, settings):
    """The same sequence through Redis and in-process gives the same admissions, refusals (what they
    say but the random names) and headers."""
    import redis.asyncio as aioredis

    if not settings.REDIS_URL:
        pytest.skip("no Redis")

    async def sequence(limiter, p):
        outcomes = []
        for step in range(3):
            try:
                admission = await limiter.admit(p, f"r{step}")
                outcomes.append(("ok", headers_of(admission), admission.budget_warning))
            except RateLimited as error:
                said = {name: value for name, value in error.details.items() if name != "scope"}
                outcomes.append((error.code, headers_of(error), said))
            if step == 0:
                limiter.settle(p, f"r{step}", 5)
                await limiter.drain()
        return outcomes

    async def both():
        redis = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            through_redis = await sequence(Limiter(redis, lease_seconds=60, clock=Clock(), spent=nothing_spent_before),
                                           plan(**levels))
        finally:
            await redis.aclose()
        in_process = await sequence(LocalLimiter(lease_seconds=60, clock=Clock(), spent=nothing_spent_before),
                                    plan(**levels))
        return through_redis, in_process

    through_redis, in_process = run(both())
    assert through_redis == in_process
    assert any(outcome[0] != "ok" or outcome[2] is True for outcome in in_process)


def test_the_gateway_chooses_the_local_limiter_without_redis():
    from gateway.app import Gateway

    async def start_and_stop():
        gateway = Gateway()
        await gateway.startup()
        try:
            return type(gateway.limiter)
        finally:
            await gateway.shutdown()

    with override_settings(REDIS_URL=None):
        assert run(start_and_stop()) is LocalLimiter
