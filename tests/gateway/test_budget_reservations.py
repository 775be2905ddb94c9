"""A hard token budget is not overshot by requests in flight together: each admission reserves what
the request may cost at most, held until it settles (or its lease runs out), and one whose
reservation does not fit is refused before it reaches an engine. The same in Redis (several gateway
processes) and in the embedded mode's own counters, and through a real gateway."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from gateway import bodies
from gateway.errors import BudgetExceeded
from gateway.limits import Budget, Level, Limiter, LocalLimiter, Plan
from gateway.models import UsageRecord
from tenancy.services import contracts
from tests.assets.waiting import wait_until

START = 1_700_000_060.0


class Clock:
    def __init__(self, now=START):
        self.now = now

    def __call__(self):
        return self.now


def nothing_spent_before(path, since, until):
    return 0


def plan(ident, daily=None, monthly=None, hard=True, weekly=None):
    return Plan.build([Level("client", f"client:{ident}", 1000, None, None)],
                      [Budget(f"org{ident[:10]}", daily, monthly, hard, weekly=weekly)])


@pytest.fixture(params=["redis", "local"])
def limiters(request):
    """``limiters(count, clock)``: that many limiters sharing one fleet's counters — Redis ones, each on
    its own connection as separate gateway processes are, or the embedded mode's one process."""
    kind = request.param
    if kind == "redis" and not settings.REDIS_URL:
        pytest.fail("the Redis limiter needs REDIS_URL (the embedded mode has no Redis)")
    opened = []

    def make(count, clock, lease_seconds=60):
        if kind == "local":
            one = LocalLimiter(lease_seconds=lease_seconds, clock=clock, spent=nothing_spent_before)
            return [one] * count
        made = []
        for _ in range(count):
            connection = aioredis.Redis.from_url(settings.REDIS_URL)
            opened.append(connection)
            made.append(Limiter(connection, lease_seconds=lease_seconds, clock=clock, spent=nothing_spent_before))
        return made

    make.ident = uuid.uuid4().hex
    yield make
    if kind == "redis":  # this test's counters go
        client = redis.Redis.from_url(settings.REDIS_URL)
        for key in client.scan_iter(f"berth:gw:*{make.ident[:10]}*"):
            client.delete(key)
        client.close()


async def try_admit(limiter, p, request_id, reserve):
    try:
        await limiter.admit(p, request_id, reserve)
    except BudgetExceeded as error:
        return error
    return None


def test_requests_in_flight_together_never_reserve_more_than_the_budget_holds(limiters):
    clock = Clock()
    ident = limiters.ident

    async def steps():
        fleet = limiters(3, clock)
        p = plan(ident, daily=1000)
        outcomes = await asyncio.gather(*(try_admit(fleet[i % 3], p, f"r{i}", 100) for i in range(25)))
        admitted = [i for i, refused in enumerate(outcomes) if refused is None]
        assert len(admitted) == 10  # 10 × 100 reserved: the budget's 1,000, and not one more
        refused = next(r for r in outcomes if r is not None)
        assert refused.code == "budget_exceeded"
        assert refused.details["room"] == 0 and refused.details["reserved"] == 100
        assert refused.details["period"] == "day"
        # Each used less than it reserved: the holds go, the real use is charged.
        for i in admitted:  # each by the process that admitted it
            fleet[i % 3].settle(p, f"r{i}", 40, 100)
        for limiter in fleet:
            await limiter.drain()
        outcomes = await asyncio.gather(*(try_admit(fleet[0], p, f"s{i}", 100) for i in range(10)))
        assert sum(r is None for r in outcomes) == 6  # 1,000 - 400 spent leaves room for six
        too_big = await try_admit(fleet[1], p, "big", 50)
        assert too_big is not None and too_big.details["room"] == 0
        return True

    assert asyncio.run(steps())


def test_a_reservation_larger_than_the_room_left_is_refused_naming_both(limiters):
    clock = Clock()
    ident = limiters.ident

    async def steps():
        [limiter] = limiters(1, clock)
        p = plan(ident, daily=1000, monthly=600)  # the tighter one binds, and is the one reported
        assert await try_admit(limiter, p, "a", 500) is None
        limiter.settle(p, "a", 500, 500)
        await limiter.drain()
        refused = await try_admit(limiter, p, "b", 200)
        assert refused.details["room"] == 100 and refused.details["period"] == "month"
        assert "has room for 100 tokens" in refused.message and "up to 200" in refused.message
        assert await try_admit(limiter, p, "c", 100) is None  # what fits is admitted
        return True

    assert asyncio.run(steps())


def test_reservations_in_flight_together_never_overshoot_a_nearly_spent_weekly_budget(limiters):
    """The weekly counter holds against requests in flight as the daily one does, while the day and
    the month have room to spare."""
    clock = Clock()
    ident = limiters.ident

    async def steps():
        fleet = limiters(3, clock)
        p = plan(ident, daily=100_000, weekly=1000, monthly=1_000_000)
        assert await try_admit(fleet[0], p, "first", 700) is None
        fleet[0].settle(p, "first", 700, 700)
        await fleet[0].drain()
        outcomes = await asyncio.gather(*(try_admit(fleet[i % 3], p, f"r{i}", 40) for i in range(24)))
        admitted = [i for i, refused in enumerate(outcomes) if refused is None]
        assert len(admitted) == 7  # 300 left: seven reservations of 40, and not one more
        refused = next(r for r in outcomes if r is not None)
        assert refused.details["period"] == "week" and refused.details["budget"] == "weekly"
        assert refused.details["room"] == 20 and refused.details["limit"] == 1000
        assert refused.message.startswith("The weekly token budget of ")
        for i in admitted:  # each used all it reserved: the week is spent to the token, not past it
            fleet[i % 3].settle(p, f"r{i}", 40, 40)
        for limiter in fleet:
            await limiter.drain()
        spent = await try_admit(fleet[1], p, "after", 20)
        assert spent is None  # the 20 tokens left fit exactly
        fleet[1].settle(p, "after", 20, 20)
        await fleet[1].drain()
        used_up = await try_admit(fleet[2], p, "late", 1)
        assert used_up is not None and used_up.details["room"] == 0
        assert used_up.message == f"The weekly token budget of org{ident[:10]} is used up."
        # Not before Monday 00:00 UTC: START is a Tuesday, 2023-11-14 22:14:20.
        assert int(dict(used_up.headers)[b"retry-after"]) == 6 * 86400 - (22 * 3600 + 14 * 60 + 20)
        return True

    assert asyncio.run(steps())


@pytest.mark.parametrize(("spend", "period", "room"), [
    (150, "day", 50),  # day 200, week 500, month 2000: after 150, the day has least room
    (0, "week", 150),  # a week already 350 in (yesterday) binds before the day's 200
    (0, "month", 100),  # and a month already 1900 in binds tighter than either
])
def test_day_week_and_month_on_one_scope_the_tightest_is_reported(limiters, spend, period, room):
    clock = Clock()
    ident = limiters.ident

    async def steps():
        [limiter] = limiters(1, clock)
        p = plan(ident, daily=200, weekly=500, monthly=2000)
        if period == "week":  # spent earlier this week: yesterday, a day whose counter is gone
            clock.now = START - 86400
            assert await try_admit(limiter, p, "yesterday", 0) is None
            limiter.settle(p, "yesterday", 350)
            await limiter.drain()
            clock.now = START
        if period == "month":  # and earlier this month, the week before
            clock.now = START - 7 * 86400
            assert await try_admit(limiter, p, "last week", 0) is None
            limiter.settle(p, "last week", 1900)
            await limiter.drain()
            clock.now = START
        assert await try_admit(limiter, p, "a", 0) is None
        limiter.settle(p, "a", spend)
        await limiter.drain()
        refused = await try_admit(limiter, p, "b", room + 1)
        adjective = {"day": "daily", "week": "weekly", "month": "monthly"}[period]
        assert (refused.details["period"], refused.details["budget"], refused.details["room"]) == \
            (period, adjective, room)
        assert refused.message.startswith(f"The {adjective} token budget of org{ident[:10]} has room for {room} ")
        assert (refused.details["daily"], refused.details["weekly"], refused.details["monthly"]) == (200, 500, 2000)
        assert await try_admit(limiter, p, "c", room) is None  # what fits the tightest is admitted
        return True

    assert asyncio.run(steps())


def test_periods_used_up_together_report_the_longest_and_retry_after_its_end(limiters):
    """A day and a week both used up: the week binds for longer, so it is named and Retry-After waits
    for Monday, not for midnight (the day's end would admit nothing)."""
    clock = Clock()
    ident = limiters.ident

    async def steps():
        [limiter] = limiters(1, clock)
        p = plan(ident, daily=300, weekly=300, monthly=10_000)
        assert await try_admit(limiter, p, "a", 0) is None
        limiter.settle(p, "a", 350)  # more than both (a request served whole past the edge)
        await limiter.drain()
        refused = await try_admit(limiter, p, "b", 10)
        assert refused.details["period"] == "week" and refused.details["room"] == 0
        assert "weekly token budget" in refused.message and "is used up" in refused.message
        assert int(dict(refused.headers)[b"retry-after"]) > 86400
        return True

    assert asyncio.run(steps())


def test_budgets_up_the_tree_the_tightest_of_any_is_reported(limiters):
    """A project's daily budget has room for 400; its organisation's weekly one for 100: the
    organisation's week binds, and is named, though the project's day is nearer."""
    clock = Clock()
    ident = limiters.ident

    async def steps():
        [limiter] = limiters(1, clock)
        org, project = f"org{ident[:10]}", f"org{ident[:10]}/ml/search"
        p = Plan.build([Level("client", f"client:{ident}", 1000, None, None)],
                       [Budget(project, 1000, None, True), Budget(org, None, None, True, weekly=700)])
        assert await try_admit(limiter, p, "a", 0) is None
        limiter.settle(p, "a", 600)
        await limiter.drain()
        refused = await try_admit(limiter, p, "b", 150)
        assert refused.details["scope"] == org and refused.details["period"] == "week"
        assert refused.details["room"] == 100
        assert refused.message.startswith(f"The weekly token budget of {org} has room for 100 tokens")
        return True

    assert asyncio.run(steps())


def test_a_hold_whose_request_never_settled_goes_with_its_lease(limiters):
    clock = Clock()
    ident = limiters.ident

    async def steps():
        [limiter] = limiters(1, clock, lease_seconds=30)
        p = plan(ident, daily=1000)
        assert await try_admit(limiter, p, "lost", 900) is None  # its process dies: never settled
        assert await try_admit(limiter, p, "next", 200) is not None
        clock.now += 31
        assert await try_admit(limiter, p, "next", 200) is None
        return True

    assert asyncio.run(steps())


def test_a_soft_budget_holds_nothing_and_only_warns(limiters):
    clock = Clock()
    ident = limiters.ident

    async def steps():
        [limiter] = limiters(1, clock)
        p = plan(ident, daily=100, hard=False)
        assert not p.reserves
        admissions = [await limiter.admit(p, f"r{i}", 80) for i in range(3)]
        assert not any(a.budget_warning for a in admissions)
        for i in range(3):
            limiter.settle(p, f"r{i}", 80, 80)
        await limiter.drain()
        assert (await limiter.admit(p, "late", 80)).budget_warning
        return True

    assert asyncio.run(steps())


@pytest.mark.parametrize(("endpoint", "payload", "cap", "context", "expected"), [
    # the prompt: at most a token a byte of the body (30 here), and the template's 64
    ("chat/completions", {"max_tokens": 50}, None, None, (30 + 64 + 50, None)),
    ("chat/completions", {"max_tokens": 50, "n": 3}, None, None, (30 + 64 + 150, None)),
    ("chat/completions", {}, 200, None, (30 + 64 + 200, 200)),  # no limit named: the model's cap
    ("chat/completions", {}, None, 1024, (30 + 64 + 1024, 1024)),  # no cap: the default, within the context
    ("chat/completions", {}, None, None, (30 + 64 + 4096, 4096)),
    ("responses", {"max_output_tokens": 7}, None, None, (30 + 64 + 7, None)),
    ("embeddings", {}, None, None, (30 + 64, None)),  # nothing generated: the prompt alone
])
def test_what_a_request_reserves(endpoint, payload, cap, context, expected):
    route = type("Route", (), {"context": context})()
    assert bodies.reservation(endpoint, payload, 30, cap, route, 4096) == expected


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("figure", ["daily_token_budget", "weekly_token_budget"])
def test_concurrent_requests_against_a_nearly_spent_hard_budget_overshoot_it_by_zero_tokens(
        gateway, gateway_b, tiny_engine, deploy, make_key, tree, figure):
    deploy("tiny", tiny_engine, task="completion")
    budget = 1000
    # The other periods have room to spare: only the one under test binds.
    roomy = {name: 10**9 for name in ("daily_token_budget", "weekly_token_budget", "monthly_token_budget")}
    contracts.set_contract(tree.actor, tree.org, budget_mode="hard", **(roomy | {figure: budget}))
    caller = make_key()

    def complete(process, max_tokens):
        return httpx.post(f"{process.base_url}/v1/completions", headers={"Authorization": f"Bearer {caller.key}"},
                          timeout=120, json={"model": "tiny", "prompt": "a", "max_tokens": max_tokens,
                                             "ignore_eos": True})

    # Spend most of it, then let 24 requests through two gateway processes race for what is left.
    assert complete(gateway, 300).status_code == 200
    wait_until(lambda: UsageRecord.objects.filter(client_id=caller.client.pk).exists(), 20, what="the spend recorded")
    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(lambda i: complete((gateway, gateway_b)[i % 2], 40), range(24)))
    statuses = [a.status_code for a in answers]
    assert set(statuses) == {200, 429}, statuses
    assert all(a.json()["error"]["code"] == "budget_exceeded" for a in answers if a.status_code == 429)
    wait_until(lambda: UsageRecord.objects.filter(client_id=caller.client.pk).count() == 25, 20,
               what="every request recorded")
    spent = sum((r.prompt_tokens or 0) + (r.completion_tokens or 0)
                for r in UsageRecord.objects.filter(client_id=caller.client.pk))
    # Without reservations all 24 pass at the edge: about 24 × 41 tokens on top of the 300 first spent.
    assert spent <= budget, (spent, statuses)
    assert statuses.count(200) >= 2  # what fitted was served
