"""The limiter when Redis fails, on a private redis-server each test starts (never the shared one):
budgets that Redis lost are rebuilt from the usage records, a stalled Redis is answered 503
``limiter_unavailable`` at once and admitted again when it wakes, with no lease left behind."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone

import httpx
import pytest
from django.db import connection

from gateway.errors import BudgetExceeded, ConcurrencyLimited, RateLimited
from gateway.limits import PREFIX, Budget, Level, Limiter, LocalLimiter, Plan, limiter_client, spent_in_database
from gateway.models import UsageRecord
from gateway.usage import write_batch
from tests.assets.redis_server import RedisServer
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess

NOW = datetime(2026, 3, 14, 15, 9, 26, tzinfo=timezone.utc).timestamp()  # a Saturday
DAY, WEEK, MONTH = "20260314", "202611", "202603"  # ISO week 11: Monday 9 March to Monday 16 March


class Clock:
    def __init__(self, now=NOW):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def private_redis(artifacts_dir):
    server = RedisServer(artifacts_dir / f"redis-private-{uuid.uuid4().hex[:6]}.log")
    yield server
    server.stop()


def record(path: str, tokens: int, at: float = NOW) -> None:
    """A usage record as the gateway writes it: ``tokens`` charged to the project ``path`` at ``at``."""
    write_batch([{"request_id": uuid.uuid4().hex, "started_at": at - 1, "finished_at": at, "endpoint": "completions",
                  "stream": False, "status": 200, "total_ms": 1000.0, "prompt_tokens": 1,
                  "completion_tokens": tokens - 1, "scope_path": path}])


async def record_meanwhile(path: str, tokens: int) -> None:
    """``record`` from a coroutine (the ORM is synchronous): in a thread whose connection is closed after."""
    def write():
        try:
            record(path, tokens)
        finally:
            connection.close()

    await asyncio.to_thread(write)


def spent(path, since, until):
    """The real sum over the usage records (the limiter's default), with the database thread's
    connection closed after: the test database must be free to drop at the end of the session."""
    try:
        return spent_in_database(path, since, until)
    finally:
        connection.close()


def budget_plan(path: str, daily=None, monthly=None, weekly=None, **level) -> Plan:
    levels = [Level("client", f"client:{uuid.uuid4().hex}", level.get("rpm"), level.get("tpm"),
                    level.get("concurrency"))]
    return Plan.build(levels, [Budget(path, daily, monthly, True, weekly=weekly)] if daily or weekly or monthly else [])


def connect(server: RedisServer, timeout: float = 0.25):
    """A client as the gateway's limiter has one (``BERTH_GATEWAY_REDIS_TIMEOUT_MS``, 250 by default)."""
    return limiter_client(server.url, timeout)


async def eventually(condition, timeout: float, what: str):
    """``wait_until`` for a coroutine condition, polled on the event loop (which the limiter's own
    tasks need to keep running)."""
    deadline = time.monotonic() + timeout
    while not (result := await condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout:.0f}s")
        await asyncio.sleep(0.05)
    return result


async def refused(limiter, plan, request_id="r") -> RateLimited | None:
    try:
        await limiter.admit(plan, request_id)
    except RateLimited as error:
        return error
    return None


@pytest.mark.django_db(transaction=True)
def test_an_exhausted_budget_is_rebuilt_from_the_usage_records_after_redis_restarts_empty(private_redis):
    org = "o" + uuid.uuid4().hex[:10]
    plan = budget_plan(org, daily=1000, monthly=50_000)
    record(f"{org}/ml/search", 600)
    record(f"{org}/ml", 300, at=NOW - 3600)  # the team's own usage, earlier today
    record(f"{org}x/ml/search", 5000)  # another organisation whose slug starts the same
    record(f"{org}/ml/search", 7000, at=NOW - 86400)  # yesterday: this month's, not today's

    async def steps():
        client = connect(private_redis)
        limiter = Limiter(client, lease_seconds=60, clock=Clock(), spent=spent)
        try:
            await limiter.admit(plan, "a")  # 900 of 1000 spent today: admitted
            limiter.settle(plan, "a", 200)  # ... and the answer charges 200 more
            await limiter.drain()
            await record_meanwhile(f"{org}/ml/search", 200)  # (the gateway writes its usage record)
            assert isinstance(await refused(limiter, plan), BudgetExceeded)
            private_redis.restart()  # Redis comes back with nothing: no counter, no script
            error = await refused(limiter, plan)
            assert isinstance(error, BudgetExceeded), error
            assert int(dict(error.headers)[b"retry-after"]) > 60  # the end of the day
            return (int(await client.get(f"{PREFIX}budget:{org}:d:{DAY}")),
                    int(await client.get(f"{PREFIX}budget:{org}:m:{MONTH}")))
        finally:
            await client.aclose()

    assert asyncio.run(steps()) == (1100, 8100)


def record_this_week_and_around(org: str) -> None:
    """Today 300, Wednesday 500 (this week), Sunday 4,000 (last week, this month), and another
    organisation whose slug starts the same."""
    record(f"{org}/ml/search", 300)
    record(f"{org}/ml", 500, at=NOW - 3 * 86400)
    record(f"{org}/ml/search", 4000, at=datetime(2026, 3, 8, 23, 59, tzinfo=timezone.utc).timestamp())
    record(f"{org}x/ml/search", 9000)


@pytest.mark.django_db(transaction=True)
def test_a_lost_week_counter_is_rebuilt_from_this_weeks_usage_records(private_redis):
    """Redis loses the week's counter alone (an eviction): it is rebuilt from the records of Monday on,
    and the week, used up though the day and the month have room, still refuses."""
    org = "o" + uuid.uuid4().hex[:10]
    plan = budget_plan(org, daily=1000, weekly=1000, monthly=50_000)
    record_this_week_and_around(org)

    async def counters(client):
        found = await client.mget([f"{PREFIX}budget:{org}:{kind}:{period}"
                                   for kind, period in (("d", DAY), ("w", WEEK), ("m", MONTH))])
        return tuple(int(count) for count in found)

    async def steps():
        client = connect(private_redis)
        limiter = Limiter(client, lease_seconds=60, clock=Clock(), spent=spent)
        try:
            await limiter.admit(plan, "a")  # 800 of the week's 1,000: admitted
            assert await counters(client) == (300, 800, 4800)
            limiter.settle(plan, "a", 250)
            await limiter.drain()
            await record_meanwhile(f"{org}/ml/search", 250)
            error = await refused(limiter, plan)
            assert isinstance(error, BudgetExceeded) and error.details["period"] == "week", error
            assert await client.delete(f"{PREFIX}budget:{org}:w:{WEEK}") == 1
            error = await refused(limiter, plan)
            assert isinstance(error, BudgetExceeded) and error.details["period"] == "week", error
            assert error.message == f"The weekly token budget of {org} is used up."
            assert int(dict(error.headers)[b"retry-after"]) == round(
                datetime(2026, 3, 16, tzinfo=timezone.utc).timestamp() - NOW)  # Monday 00:00
            return await counters(client)
        finally:
            await client.aclose()

    assert asyncio.run(steps()) == (550, 1050, 5050)


@pytest.mark.django_db(transaction=True)
def test_a_settlement_redis_may_have_missed_drops_the_week_counter_with_the_others(private_redis):
    """A settlement cut off by a stalled Redis may or may not have charged: once Redis answers, the
    day's, week's and month's counters go, to be rebuilt from the usage records."""
    org = "o" + uuid.uuid4().hex[:10]
    plan = budget_plan(org, daily=1000, weekly=5000, monthly=50_000)
    keys = [f"{PREFIX}budget:{org}:{kind}:{period}" for kind, period in (("d", DAY), ("w", WEEK), ("m", MONTH))]

    async def steps():
        client = connect(private_redis, timeout=0.2)
        limiter = Limiter(client, lease_seconds=60, clock=Clock(), spent=spent)
        try:
            await limiter.admit(plan, "a")
            assert await client.exists(*keys) == 3
            private_redis.pause()
            try:
                limiter.settle(plan, "a", 40)
                await limiter.drain()  # it times out: the repair waits for Redis
            finally:
                private_redis.resume()

            async def dropped():
                return await client.exists(*keys) == 0

            await eventually(dropped, 15, "the budget counters dropped")
            return True
        finally:
            await limiter.aclose()

    assert asyncio.run(steps())


@pytest.mark.django_db(transaction=True)
def test_two_processes_rebuilding_one_budget_at_once_count_it_once(private_redis):
    org = "o" + uuid.uuid4().hex[:10]
    plan = budget_plan(org, daily=1000)
    record(org, 400)

    async def steps():
        clients = [connect(private_redis) for _ in range(2)]
        limiters = [Limiter(client, lease_seconds=60, clock=Clock(), spent=spent) for client in clients]
        try:
            await asyncio.gather(*(limiter.admit(plan, f"r{n}") for n, limiter in enumerate(limiters * 3)))
            return int(await clients[0].get(f"{PREFIX}budget:{org}:d:{DAY}"))
        finally:
            for client in clients:
                await client.aclose()

    assert asyncio.run(steps()) == 400


@pytest.mark.django_db(transaction=True)
def test_a_budget_that_cannot_be_rebuilt_refuses_with_503_rather_than_admit(private_redis):
    plan = budget_plan("o" + uuid.uuid4().hex[:10], daily=1000)

    def database_down(path, since, until):
        raise OSError("connection refused")

    async def steps():
        client = connect(private_redis)
        try:
            await Limiter(client, lease_seconds=60, clock=Clock(), spent=database_down).admit(plan, "r")
        finally:
            await client.aclose()

    with pytest.raises(Exception) as refusal:
        asyncio.run(steps())
    assert getattr(refusal.value, "code", None) == "limiter_unavailable"
    assert dict(refusal.value.headers)[b"retry-after"] == b"5"


@pytest.mark.django_db(transaction=True)
def test_the_embedded_limiter_rebuilds_budgets_from_the_usage_records_when_it_starts():
    """A restart of the one process of the embedded mode loses its counters as Redis would."""
    org = "o" + uuid.uuid4().hex[:10]
    plan = budget_plan(org, daily=1000)
    record(f"{org}/ml/search", 999)

    async def steps():
        first = LocalLimiter(lease_seconds=60, clock=Clock(), spent=spent)
        await first.admit(plan, "a")
        first.settle(plan, "a", 5)
        await record_meanwhile(f"{org}/ml/search", 5)
        assert isinstance(await refused(first, plan), BudgetExceeded)
        restarted = LocalLimiter(lease_seconds=60, clock=Clock(), spent=spent)
        return await refused(restarted, plan)

    assert isinstance(asyncio.run(steps()), BudgetExceeded)


@pytest.mark.django_db(transaction=True)
def test_the_embedded_limiter_rebuilds_the_week_from_the_usage_records_when_it_starts():
    org = "o" + uuid.uuid4().hex[:10]
    plan = budget_plan(org, daily=1000, weekly=1000, monthly=50_000)
    record_this_week_and_around(org)

    async def steps():
        first = LocalLimiter(lease_seconds=60, clock=Clock(), spent=spent)
        await first.admit(plan, "a")  # 800 this week
        first.settle(plan, "a", 200)
        await record_meanwhile(f"{org}/ml/search", 200)
        error = await refused(first, plan)
        assert isinstance(error, BudgetExceeded) and error.details["period"] == "week", error
        restarted = LocalLimiter(lease_seconds=60, clock=Clock(), spent=spent)
        return await refused(restarted, plan)

    error = asyncio.run(steps())
    assert isinstance(error, BudgetExceeded) and error.details["period"] == "week", error
    assert error.details["room"] == 0 and "weekly token budget" in error.message


def test_an_admission_cut_off_by_a_stalled_redis_holds_no_lease_once_it_wakes(private_redis):
    """The ADMIT sent before the timeout still runs when Redis wakes (it sat in the socket): its lease
    id was voided meanwhile, so it takes no lease, and a concurrency of 1 is free again at once
    (not after the lease, 10 minutes here)."""
    plan = budget_plan("", concurrency=1)

    async def steps():
        client = connect(private_redis, timeout=0.2)
        limiter = Limiter(client, lease_seconds=600)
        try:
            await limiter.admit(plan, "first")
            limiter.settle(plan, "first", 0)
            await limiter.drain()
            private_redis.pause()
            try:
                started = time.monotonic()
                with pytest.raises(Exception) as stalled:
                    await limiter.admit(plan, "cut-off")
                assert time.monotonic() - started < 1.5
                assert not isinstance(stalled.value, RateLimited)
            finally:
                private_redis.resume()

            async def free():
                try:
                    await limiter.admit(plan, "after")
                except ConcurrencyLimited:
                    return False
                return True

            await eventually(free, 15, "the one slot free again")
            voided = await client.keys(f"{PREFIX}void:*")
            assert len(voided) == 1
        finally:
            await limiter.aclose()

    asyncio.run(steps())


# The gateway itself, as a process with the private Redis as its REDIS_URL.

def complete(gateway, key, timeout=60, **extra):
    return httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      timeout=timeout, json={"model": "tiny", "prompt": "a", "max_tokens": 1, **extra})


def tokens_recorded(path: str) -> int:
    return sum(r.total_tokens or 0 for r in UsageRecord.objects.filter(scope_path__startswith=path))


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_an_exhausted_budget_stays_exhausted_when_the_gateways_redis_restarts_empty(
        private_redis, tiny_engine, deploy, make_key, tree, artifacts_dir):
    from tenancy.services import contracts

    deploy("tiny", tiny_engine, task="completion")
    contracts.set_contract(tree.actor, tree.org, daily_token_budget=1000, budget_mode="hard")
    caller = make_key()
    gateway = GatewayProcess(artifacts_dir / "gateway-budget-loss.log", environ={"REDIS_URL": private_redis.url})
    try:
        served = []

        def spend():
            answer = complete(gateway, caller.key, max_tokens=300, ignore_eos=True)
            assert answer.status_code in (200, 429), answer.text
            served.append(answer.status_code == 200)
            return answer.status_code == 429 and answer

        # Spent as far as it goes: what is left cannot hold another such request's reservation.
        answer = wait_until(spend, 120, interval=0, what="the 1,000-token budget spent")
        assert answer.json()["error"]["code"] == "budget_exceeded" and sum(served) >= 2
        wait_until(lambda: UsageRecord.objects.filter(scope_path__startswith=tree.org.path).count() >= len(served), 10,
                   what="the usage records written")
        assert tokens_recorded(tree.org.path) <= 1000  # never overshot
        private_redis.restart()  # the counter is rebuilt from the usage records: the same request is refused
        answer = complete(gateway, caller.key, max_tokens=300, ignore_eos=True)
        assert answer.status_code == 429 and answer.json()["error"]["code"] == "budget_exceeded", answer.text
    finally:
        gateway.stop()


@pytest.mark.llama
@pytest.mark.django_db(transaction=True)
def test_a_stalled_redis_is_answered_503_at_once_and_admitted_again_when_it_wakes(
        private_redis, tiny_engine, deploy, make_key, artifacts_dir):
    deploy("tiny", tiny_engine, task="completion")
    caller = make_key(rpm_limit=1000, concurrency_limit=1)
    gateway = GatewayProcess(artifacts_dir / "gateway-redis-stall.log", environ={"REDIS_URL": private_redis.url})
    try:
        assert complete(gateway, caller.key).status_code == 200
        private_redis.pause()
        try:
            for _ in range(5):
                started = time.monotonic()
                answer = complete(gateway, caller.key, timeout=10)
                assert time.monotonic() - started < 2
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "limiter_unavailable"
                assert answer.headers["retry-after"] == "1"
        finally:
            private_redis.resume()
        # The admissions cut off may run now that Redis wakes: they must leave the one slot free.
        wait_until(lambda: complete(gateway, caller.key, timeout=10).status_code == 200, 15,
                   what="requests admitted again once Redis answers")
        assert [complete(gateway, caller.key).status_code for _ in range(3)] == [200, 200, 200]
    finally:
        gateway.stop()
