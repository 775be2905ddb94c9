"""Workload priority at the engines' door. A request whose model has every slot of its ready
replicas busy (as this gateway process counts them) waits here, and when a slot frees it goes to the
waiter of the highest priority of its client (critical, high, normal, low, batch), the earliest of
those. Engines serve what they are sent in order of arrival, so ordering it here is what lets a
critical request pass a batch burst: it waits for the requests already in flight, not the queue.

Each model's queue is bounded: when it is full the lowest priority gives way. A newcomer above the
lowest waiter takes that one's place (the waiter is answered 429 ``server_busy`` with Retry-After);
a newcomer at or below it is answered so itself. So is a waiter that waits past the wait limit.
Several gateway processes each order their own requests (each counts the slots as its own)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools

from gateway import metrics
from gateway.errors import ServerBusy

RANK = {"critical": 0, "high": 1, "normal": 2, "low": 3, "batch": 4}


class SlotGate:
    def __init__(self, queue_size: int, wait_seconds: float):
        self.queue_size = queue_size
        self.wait_seconds = wait_seconds
        self.busy: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.waiting: dict[str, list] = {}  # model → heap of [rank, arrival, future]
        self._arrival = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, model: str, capacity: int, priority: str):
        """Hold one of ``model``'s ``capacity`` slots for the block (waiting for one in priority order)."""
        await self.acquire(model, capacity, priority)
        try:
            yield
        finally:
            self.release(model)

    def waiters(self, model: str) -> int:
        return sum(not entry[2].done() for entry in self.waiting.get(model, ()))

    async def acquire(self, model: str, capacity: int, priority: str) -> None:
        self.capacity[model] = capacity = max(1, capacity)
        busy = self.busy.get(model, 0)
        if busy < capacity and model not in self.waiting:  # (``waiting`` holds only models someone waits for)
            self.busy[model] = busy + 1
            return
        queue = self.waiting.setdefault(model, [])
        rank = RANK.get(priority, RANK["normal"])
        live = [entry for entry in queue if not entry[2].done()]
        if len(live) >= self.queue_size:
            lowest = max(live)  # the lowest priority, the latest of those
            if lowest[0] <= rank:
                raise self._busy(model, "its queue is full of requests of this priority or above")
            lowest[2].set_exception(self._busy(model, "a request of a higher priority took its place"))
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(queue, [rank, next(self._arrival), future])
        waiting = metrics.SLOT_WAITING.labels(model)
        waiting.inc()
        try:
            await asyncio.wait_for(asyncio.shield(future), self.wait_seconds)
        except asyncio.TimeoutError:
            if not self._give_up(model, future):
                return  # handed a slot at the last moment: it is ours
            raise self._busy(model, f"no slot freed within {self.wait_seconds:g} s") from None
        except asyncio.CancelledError:  # the client left while it waited
            if not self._give_up(model, future):
                self.release(model)
            raise
        finally:
            waiting.dec()

    def _give_up(self, model: str, future: asyncio.Future) -> bool:
        """Leave the queue; False when the slot had been handed over meanwhile (then it is held)."""
        if future.done() and not future.cancelled() and future.exception() is None:
            return False
        future.cancel()
        self._tidy(model)
        return True

    def release(self, model: str) -> None:
        """Free a slot: it goes to the best waiter, if any (the busy count stays)."""
        self.busy[model] = self.busy.get(model, 1) - 1
        queue = self.waiting.get(model, [])
        while queue and self.busy[model] < self.capacity.get(model, 1):
            _, _, future = heapq.heappop(queue)
            if not future.done():
                future.set_result(None)
                self.busy[model] += 1
        self._tidy(model)

    def _tidy(self, model: str) -> None:
        queue = self.waiting.get(model)
        if queue is not None and not any(not entry[2].done() for entry in queue):
            del self.waiting[model]
        if not self.busy.get(model) and model not in self.waiting:
            self.busy.pop(model, None)

    def _busy(self, model: str, why: str) -> ServerBusy:
        error = ServerBusy(f"Every replica of {model} is busy and {why}; retry shortly.",
                           details={"model": model, "waiting": self.waiters(model)})
        error.headers = [(b"retry-after", b"1")]
        return error
