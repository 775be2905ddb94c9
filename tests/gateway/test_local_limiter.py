"""The in-process limiter of the embedded mode (no Redis): the Lua script's semantics, in one process."""

import asyncio
import uuid

import pytest
from django.test import override_settings

from gateway.errors import BudgetExceeded, ConcurrencyLimited, RateLimited
from gateway.limits import Budget, Level, Limiter, LocalLimiter, Plan

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
                      [Budget(f"org{ident[:6]}", levels.get("daily"), levels.get("monthly"), levels.get("hard", True))]
                      if levels.get("daily") or levels.get("monthly") else [])


def run(coroutine):
    return asyncio.run(coroutine)


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
    assert refused.value.code == "rate_limit_exceeded" and int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # Next minute, 30 s in: the previous bucket still weighs half of 3 = 1.5, so one more fits, not two.
    clock.now += 70
    run(limiter.admit(p, "r"))
    with pytest.raises(RateLimited):
        run(limiter.admit(p, "r"))
    # Two minutes on, the window is empty again.
    clock.now += 120
    run(limiter.admit(p, "r"))


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
    limiter = LocalLimiter(lease_seconds=60, clock=clock)
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


@pytest.mark.parametrize("levels", [{"rpm": 2}, {"concurrency": 1}, {"daily": 5}])
def test_same_answers_as_the_lua_script(levels, settings):
    """The same sequence through Redis and in-process gives the same admissions and refusals."""
    import redis.asyncio as aioredis

    if not settings.REDIS_URL:
        pytest.skip("no Redis")

    async def sequence(limiter, p):
        outcomes = []
        for step in range(3):
            try:
                admission = await limiter.admit(p, f"r{step}")
                outcomes.append(("ok", headers_of(admission).get("x-ratelimit-remaining-requests")))
            except RateLimited as error:
                outcomes.append((error.code, headers_of(error).get("x-ratelimit-remaining-requests")))
            if step == 0:
                limiter.settle(p, f"r{step}", 5)
                await limiter.drain()
        return outcomes

    async def both():
        redis = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            through_redis = await sequence(Limiter(redis, lease_seconds=60), plan(**levels))
        finally:
            await redis.aclose()
        in_process = await sequence(LocalLimiter(lease_seconds=60), plan(**levels))
        return through_redis, in_process

    through_redis, in_process = run(both())
    assert through_redis == in_process
    assert any(outcome[0] != "ok" for outcome in in_process)


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
