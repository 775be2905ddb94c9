"""The gateway's routing cache: a name the table lacks is answered from a table read after the
request arrived (no Redis announces a deployment on the embedded default), and such misses cost at
most one reload per ``MISS_INTERVAL``. Plain asyncio, with a loader the test controls."""

from __future__ import annotations

import asyncio
import time

from serving.control.routing import ModelRoute, RoutingCache, RoutingTable


class Database:
    """What the loader reads: the names deployed now; ``gate`` holds a read until the test opens it."""

    def __init__(self):
        self.names: set[str] = set()
        self.reads = 0
        self.gate: asyncio.Event | None = None

    async def runner(self, loader):
        self.reads += 1
        names = set(self.names)  # what the read sees is fixed when it begins
        if self.gate is not None:
            await self.gate.wait()
        return loader(names)

    @staticmethod
    def loader(names):
        return RoutingTable(models={n: ModelRoute(name=n, task="chat", state="ready", endpoints=()) for n in names},
                            loaded_at=time.monotonic())


def cache_of(database: Database, ttl: float = 60.0) -> RoutingCache:
    return RoutingCache(ttl, database.runner, loader=database.loader)


def test_a_name_deployed_after_a_recent_read_is_found():
    async def scenario():
        database = Database()
        cache = cache_of(database)
        assert (await cache.get()).route("new") is None  # read just now, within the TTL
        database.names.add("new")
        arrived = time.perf_counter()
        assert (await cache.get()).route("new") is None  # the cached table predates the deployment
        table = await cache.read_since(arrived)
        assert table.route("new") is not None
        assert database.reads == 2

    asyncio.run(scenario())


def test_a_reload_that_began_before_the_request_is_waited_out_then_read_again():
    async def scenario():
        database = Database()
        cache = cache_of(database)
        await cache.get()
        database.gate = asyncio.Event()
        early = asyncio.ensure_future(cache.fresh())  # a read in flight, begun before the deployment
        while database.reads < 2:
            await asyncio.sleep(0)  # until that read has begun
        database.names.add("new")
        arrived = time.perf_counter()
        late = asyncio.ensure_future(cache.read_since(arrived))
        database.gate.set()
        assert (await early).route("new") is None
        assert (await late).route("new") is not None
        assert database.reads == 3

    asyncio.run(scenario())


def test_a_table_read_after_the_request_arrived_is_used_as_it_is():
    async def scenario():
        database = Database()
        cache = cache_of(database)
        arrived = time.perf_counter()
        await cache.get()
        assert (await cache.read_since(arrived)).route("absent") is None
        assert database.reads == 1  # nothing could have changed unseen: no second read

    asyncio.run(scenario())


def test_misses_share_reloads_and_are_bounded_per_interval():
    async def scenario():
        database = Database()
        cache = cache_of(database)
        await cache.get()
        began = time.perf_counter()
        rounds = 3
        for _ in range(rounds):
            arrived = time.perf_counter()
            tables = await asyncio.gather(*(cache.read_since(arrived) for _ in range(50)))
            assert all(table.route("absent") is None for table in tables)
        elapsed = time.perf_counter() - began
        assert database.reads == 1 + rounds  # 150 misses, three reloads
        # The second and third rounds each waited for the interval since the previous miss reload.
        assert elapsed >= (rounds - 1) * RoutingCache.MISS_INTERVAL

    asyncio.run(scenario())


def test_a_failed_reload_gives_back_the_previous_table():
    async def scenario():
        database = Database()
        database.names.add("kept")
        cache = cache_of(database)
        await cache.get()

        async def failing(loader):
            raise ConnectionError("database refusing connections")

        cache._runner = failing
        table = await cache.read_since(time.perf_counter())
        assert table.route("kept") is not None

    asyncio.run(scenario())
