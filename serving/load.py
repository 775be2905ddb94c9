"""Live load as the gateway sees it, for the placement loop: requests in flight per replica and
requests waiting per model (for a model with no ready replica yet).

Each gateway process publishes its own counts every few seconds (``publish``); the placement loop
sums the fresh reports (``current``). A report older than ``STALE_S`` is from a process that went
away and counts for nothing. With Redis the reports are fields of one hash (each process writes
only its own field, so processes never overwrite each other); without Redis (the embedded mode,
one web process) they live in Django's cache.

What the policy reads from this: a replica with requests in flight is active (never evicted), a
model with requests waiting is wanted now (but nothing is preempted for it while every request
waiting is at the batch priority), and load scaling compares in-flight requests with what
the replicas can take.
"""

from __future__ import annotations

import dataclasses
import json
import time

from django.conf import settings
from django.core.cache import cache

KEY = "berth:gateway:load"
STALE_S = 15.0
PUBLISH_EVERY_S = 2.0


@dataclasses.dataclass(frozen=True)
class Load:
    in_flight: dict[str, int]  # replica public id → requests in flight there
    waiting: dict[str, int]  # model name → requests waiting for it to load
    waiting_since: dict[str, float] = dataclasses.field(default_factory=dict)  # model → the oldest began (epoch s)
    waiting_batch: dict[str, int] = dataclasses.field(default_factory=dict)  # model → those at the batch priority

    def running(self, replica_ids) -> int:
        return sum(self.in_flight.get(r, 0) for r in replica_ids)


def _redis():
    import redis

    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)


def publish(process: str, in_flight: dict[str, int], waiting: dict[str, int], now: float | None = None,
            waiting_since: dict[str, float] | None = None, waiting_batch: dict[str, int] | None = None) -> None:
    """Replace this process's report (zero counts are left out: an idle process reports nothing).
    ``waiting_batch``: how many of those waiting per model are at the batch priority."""
    report = json.dumps({"at": now if now is not None else time.time(),
                         "in_flight": {k: v for k, v in in_flight.items() if v > 0},
                         "waiting": {k: v for k, v in waiting.items() if v > 0},
                         "waiting_since": {k: v for k, v in (waiting_since or {}).items() if waiting.get(k, 0) > 0},
                         "waiting_batch": {k: v for k, v in (waiting_batch or {}).items() if v > 0}})
    if settings.REDIS_URL:
        client = _redis()
        try:
            client.hset(KEY, process, report)
        finally:
            client.close()
    else:
        reports = cache.get(KEY) or {}
        reports[process] = report
        cache.set(KEY, reports, None)


def withdraw(process: str) -> None:
    """A process that shuts down takes its report with it."""
    if settings.REDIS_URL:
        client = _redis()
        try:
            client.hdel(KEY, process)
        finally:
            client.close()
    else:
        reports = cache.get(KEY) or {}
        if reports.pop(process, None) is not None:
            cache.set(KEY, reports, None)


def current(now: float | None = None) -> Load:
    """The sum of the fresh reports; stale ones are dropped on the way."""
    now = now if now is not None else time.time()
    if settings.REDIS_URL:
        client = _redis()
        try:
            reports = {k.decode(): _parse(v) for k, v in client.hgetall(KEY).items()}
            stale = [k for k, report in reports.items() if now - report["at"] > STALE_S]
            if stale:
                client.hdel(KEY, *stale)
        finally:
            client.close()
    else:
        reports = {k: _parse(v) for k, v in (cache.get(KEY) or {}).items()}
        stale = [k for k, report in reports.items() if now - report["at"] > STALE_S]
    in_flight: dict[str, int] = {}
    waiting: dict[str, int] = {}
    since: dict[str, float] = {}
    batch: dict[str, int] = {}
    for process, report in reports.items():
        if process in stale:
            continue
        for key, count in report.get("in_flight", {}).items():
            in_flight[key] = in_flight.get(key, 0) + int(count)
        for key, count in report.get("waiting", {}).items():
            waiting[key] = waiting.get(key, 0) + int(count)
        for key, began in report.get("waiting_since", {}).items():
            since[key] = min(float(began), since.get(key, float(began)))
        for key, count in report.get("waiting_batch", {}).items():
            batch[key] = batch.get(key, 0) + int(count)
    return Load(in_flight=in_flight, waiting=waiting, waiting_since=since, waiting_batch=batch)


def _parse(value) -> dict:
    """A report as published; one that cannot be read is as old as can be (stale, dropped)."""
    try:
        report = json.loads(value)
        report["at"] = float(report.get("at", 0))
        return report
    except (ValueError, TypeError, AttributeError):
        return {"at": 0.0}


# When each model was last asked for: the gateway reports it with its usage batches, the placement
# policy reads it to stop on-demand models idle past their timeout.

def _used_key(name: str) -> str:
    return f"berth:ondemand:last-used:{name}"


def note_used(last_used: dict[str, float]) -> None:
    """Record when models were last asked for (epoch seconds); the gateway calls this in batches."""
    if last_used:
        cache.set_many({_used_key(name): at for name, at in last_used.items()}, None)


def last_used(names, running, now: float | None = None) -> dict[str, float]:
    """When each of ``names`` was last used (epoch seconds), where known. A model in ``running``
    whose last use is not known (the gateway has not served it since a restart) starts its idle
    clock now: not known is not idle."""
    now = now or time.time()
    names = sorted(set(names))
    seen = cache.get_many([_used_key(name) for name in names])
    found = {name: float(seen[_used_key(name)]) for name in names if _used_key(name) in seen}
    fresh = {name: now for name in set(running) - set(found)}
    if fresh:
        cache.set_many({_used_key(name): at for name, at in fresh.items()}, None)
    return {**found, **fresh}
