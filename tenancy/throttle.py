"""Failed-login counters with bounded memory that a flood cannot wash out.

Each counter table (one for accounts, one for addresses) holds at most ``capacity`` entries per
window. When it is full, the entry with the *fewest* failures goes, not the oldest: an attacker who
floods invented addresses (one failure each) only displaces other one-failure entries, and the
counter of the address actually guessing a password — high by then — stays. With Redis the tables
are sorted sets shared by every web process (one script call per check); without it (the embedded
mode) they live in the process.
"""

from __future__ import annotations

import threading
import time

from django.conf import settings

_RECORD = """
local count = redis.call('ZINCRBY', KEYS[1], 1, ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
local size = redis.call('ZCARD', KEYS[1])
local capacity = tonumber(ARGV[2])
if size > capacity then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, size - capacity - 1)
end
return count
"""


class _MemoryTables:
    def __init__(self):
        self._lock = threading.Lock()
        self._tables: dict[str, dict[str, int]] = {}

    def record(self, table: str, member: str, capacity: int, ttl: int) -> None:
        with self._lock:
            self._expire_old(table)
            counts = self._tables.setdefault(table, {})
            counts[member] = counts.get(member, 0) + 1
            while len(counts) > capacity:
                # The fewest failures go first; among equals, the newest (as Redis's rank order does).
                victim = min(counts, key=lambda m: counts[m])
                del counts[victim]

    def count(self, table: str, member: str) -> int:
        with self._lock:
            return self._tables.get(table, {}).get(member, 0)

    def clear(self, table: str, member: str) -> None:
        with self._lock:
            self._tables.get(table, {}).pop(member, None)

    def _expire_old(self, table: str) -> None:
        window = table.rsplit(":", 1)[0]
        for name in [t for t in self._tables if t.rsplit(":", 1)[0] == window and t != table]:
            del self._tables[name]


class _RedisTables:
    def __init__(self, url: str):
        import redis

        self.client = redis.Redis.from_url(url)
        self.script = self.client.register_script(_RECORD)

    def record(self, table: str, member: str, capacity: int, ttl: int) -> None:
        self.script(keys=[table], args=[member, capacity, ttl])

    def count(self, table: str, member: str) -> int:
        return int(self.client.zscore(table, member) or 0)

    def clear(self, table: str, member: str) -> None:
        self.client.zrem(table, member)


class LoginThrottle:
    """Refuse a login when its account or its address failed too often within the window."""

    def __init__(self, max_failures: int, window: int, capacity: int, redis_url: str | None = None,
                 clock=time.time):
        self.max_failures = max_failures
        self.window = window
        self.capacity = capacity
        self.clock = clock
        self.tables = _RedisTables(redis_url) if redis_url else _MemoryTables()

    def _table(self, kind: str) -> str:
        return f"berth:login:{kind}:{int(self.clock() // self.window)}"

    def _keys(self, username: str, address: str | None):
        yield "account", (username or "").strip().lower()
        if address:
            yield "address", address

    def blocked(self, username: str, address: str | None) -> bool:
        return any(self.tables.count(self._table(kind), member) >= self.max_failures
                   for kind, member in self._keys(username, address))

    def failed(self, username: str, address: str | None) -> None:
        for kind, member in self._keys(username, address):
            self.tables.record(self._table(kind), member, self.capacity, self.window * 2)

    def succeeded(self, username: str, address: str | None) -> None:
        for kind, member in self._keys(username, address):
            if kind == "account":
                self.tables.clear(self._table(kind), member)

    def retry_after(self) -> int:
        return int(self.window - self.clock() % self.window) + 1


_throttle: LoginThrottle | None = None


def login_throttle() -> LoginThrottle:
    global _throttle
    if _throttle is None:
        _throttle = LoginThrottle(settings.LOGIN_MAX_FAILURES, settings.LOGIN_WINDOW_SECONDS,
                                  settings.LOGIN_TRACKED_ENTRIES, settings.REDIS_URL)
    return _throttle
