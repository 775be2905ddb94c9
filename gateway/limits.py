"""Rate limits, concurrency and token budgets up the tenancy tree, in Redis, one round trip a request.

Each level (the client, its project, team and organisation; the key itself once keys carry limits)
has its own counters:

- requests and tokens per minute as a **sliding window** estimated from two one-minute buckets
  (the previous bucket weighted by how much of it still lies in the last 60 s, plus the current one),
  so a burst at a minute boundary cannot double the rate as fixed windows allow;
- concurrent requests as a sorted set of request ids scored by a lease expiry, so a process that
  dies mid-request leaks nothing past the lease;
- token budgets per scope and UTC day/month, charged from real usage after each request.

``ADMIT`` checks every level first and charges only when all pass, atomically (a Lua script), so the
combined rate of any number of gateway processes never passes a limit. Redis's own clock (``TIME``)
is the one clock, whatever the processes' clocks say (a test may inject one instead, as for
``LocalLimiter``: ``Limiter(redis, lease, clock=...)``, so it drives time rather than waits).
``SETTLE`` runs after the response: it releases the concurrency lease and charges the tokens;
settlements are pipelined in batches so they cost the hot path nothing.

Keys are built in the script from the bases in a per-key spec (buckets are suffixed by minute),
not declared as KEYS: fine on one Redis or a replicated one; Redis Cluster would need the bases
hash-tagged to one slot and declared. Scope paths are slugs, so the spec's separators never occur.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from datetime import datetime, timezone

from gateway.errors import BudgetExceeded, ConcurrencyLimited, RateLimited

log = logging.getLogger(__name__)

PREFIX = "berth:gw:"

# ARGV: request id, lease ms, day (YYYYMMDD), month (YYYYMM), spec, and only with an injected clock
# the time in microseconds (else Redis's TIME). The spec is precomputed per key:
# "base,rpm,tpm,conc;..." for levels, then "|", then "budgetbase,daily,monthly,hard;..." (0 = none).
# Few arguments, because packing each one costs the gateway more than the script costs Redis.
ADMIT = """
local sec, usec
if ARGV[6] then
  local us = tonumber(ARGV[6])
  sec = math.floor(us / 1000000)
  usec = us - sec * 1000000
else
  local t = redis.call('TIME')
  sec, usec = tonumber(t[1]), tonumber(t[2])
end
local now_ms = sec * 1000 + math.floor(usec / 1000)
local minute = math.floor(sec / 60)
local frac = ((sec % 60) + usec / 1000000) / 60
local rid, lease, day, month, spec = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local bar = string.find(spec, '|', 1, true)
local levels, budgets = {}, {}
for base, rpm, tpm, conc in string.gmatch(string.sub(spec, 1, bar - 1), '([^,;]+),(%d+),(%d+),(%d+)') do
  levels[#levels + 1] = {base, tonumber(rpm), tonumber(tpm), tonumber(conc)}
end
for base, daily, monthly, hard in string.gmatch(string.sub(spec, bar + 1), '([^,;]+),(%d+),(%d+),(%d)') do
  budgets[#budgets + 1] = {base .. ':d:' .. day, base .. ':m:' .. month, tonumber(daily), tonumber(monthly),
                           tonumber(hard)}
end
local nl, nb = #levels, #budgets
local out = {1, '', 0, 0, 0, math.floor(frac * 1000000), 0}
local figures = {}
for i = 1, nl do
  local base, rpm, tpm, conc = levels[i][1], levels[i][2], levels[i][3], levels[i][4]
  local rc, rp, tc, tp, n = 0, 0, 0, 0, 0
  if rpm > 0 then
    rc = tonumber(redis.call('GET', base .. ':r:' .. minute) or '0')
    rp = tonumber(redis.call('GET', base .. ':r:' .. (minute - 1)) or '0')
    if out[1] == 1 and rp * (1 - frac) + rc + 1 > rpm then out = {0, 'rpm', i, rc, rp, out[6], 0} end
  end
  if tpm > 0 then
    tc = tonumber(redis.call('GET', base .. ':t:' .. minute) or '0')
    tp = tonumber(redis.call('GET', base .. ':t:' .. (minute - 1)) or '0')
    if out[1] == 1 and tp * (1 - frac) + tc >= tpm then out = {0, 'tpm', i, tc, tp, out[6], 0} end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', base .. ':c', '-inf', now_ms)
    n = redis.call('ZCARD', base .. ':c')
    if out[1] == 1 and n + 1 > conc then out = {0, 'concurrency', i, n, 0, out[6], 0} end
  end
  figures[#figures + 1] = math.floor((rp * (1 - frac) + rc) * 1000)
  figures[#figures + 1] = math.floor((tp * (1 - frac) + tc) * 1000)
end
local warn = 0
for j = 1, nb do
  local dk, mk, daily, monthly, hard = budgets[j][1], budgets[j][2], budgets[j][3], budgets[j][4], budgets[j][5]
  local over = false
  if daily > 0 and tonumber(redis.call('GET', dk) or '0') >= daily then over = true end
  if monthly > 0 and tonumber(redis.call('GET', mk) or '0') >= monthly then over = true end
  if over then
    if hard == 1 then
      if out[1] == 1 then out = {0, 'budget', j, 0, 0, out[6], 0} end
    else
      warn = warn + 1
    end
  end
end
out[7] = warn
if out[1] == 1 then
  for i = 1, nl do
    local base = levels[i][1]
    if levels[i][2] > 0 then
      local k = base .. ':r:' .. minute
      redis.call('INCR', k)
      redis.call('EXPIRE', k, 150)
      figures[2*i - 1] = figures[2*i - 1] + 1000
    end
    if levels[i][4] > 0 then
      redis.call('ZADD', base .. ':c', now_ms + lease, rid)
      redis.call('PEXPIRE', base .. ':c', lease)
    end
  end
end
for _, v in ipairs(figures) do out[#out + 1] = v end
return out
"""

# ARGV: request id, tokens, day, month, spec (as ADMIT's), and the injected time as ADMIT's.
SETTLE = """
local sec
if ARGV[6] then sec = math.floor(tonumber(ARGV[6]) / 1000000) else sec = tonumber(redis.call('TIME')[1]) end
local minute = math.floor(sec / 60)
local rid, tokens, day, month, spec = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local bar = string.find(spec, '|', 1, true)
for base, rpm, tpm, conc in string.gmatch(string.sub(spec, 1, bar - 1), '([^,;]+),(%d+),(%d+),(%d+)') do
  if tokens > 0 and tonumber(tpm) > 0 then
    local k = base .. ':t:' .. minute
    redis.call('INCRBY', k, tokens)
    redis.call('EXPIRE', k, 150)
  end
  if tonumber(conc) > 0 then redis.call('ZREM', base .. ':c', rid) end
end
if tokens > 0 then
  for base in string.gmatch(string.sub(spec, bar + 1), '([^,;]+),%d+,%d+,%d') do
    local dk, mk = base .. ':d:' .. day, base .. ':m:' .. month
    redis.call('INCRBY', dk, tokens)
    redis.call('EXPIRE', dk, 2 * 86400 + 3600)
    redis.call('INCRBY', mk, tokens)
    redis.call('EXPIRE', mk, 32 * 86400 + 3600)
  end
end
return 1
"""


@dataclasses.dataclass(frozen=True)
class Level:
    name: str  # client, project, team, org (or key)
    ident: str  # what the counters are keyed by: client:<uuid>, scope:<path>, key:<lookup>
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.concurrency)


@dataclasses.dataclass(frozen=True)
class Budget:
    path: str
    daily: int | None
    monthly: int | None
    hard: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """A principal's limits, with the script arguments that do not change per request precomputed."""

    levels: tuple[Level, ...]
    budgets: tuple[Budget, ...]

    @property
    def empty(self) -> bool:
        return not self.levels and not self.budgets

    @classmethod
    def build(cls, levels, budgets) -> "Plan":
        return cls(levels=tuple(level for level in levels if level.limited),
                   budgets=tuple(b for b in budgets if b.daily or b.monthly))

    @functools.cached_property
    def spec(self) -> str:
        levels = ";".join(f"{PREFIX}rl:{level.ident},{level.rpm or 0},{level.tpm or 0},{level.concurrency or 0}"
                          for level in self.levels)
        budgets = ";".join(f"{PREFIX}budget:{b.path},{b.daily or 0},{b.monthly or 0},{1 if b.hard else 0}"
                           for b in self.budgets)
        return f"{levels}|{budgets}"

    @functools.cached_property
    def settles(self) -> bool:
        return bool(self.budgets) or any(level.tpm or level.concurrency for level in self.levels)


@dataclasses.dataclass
class Admission:
    headers: list[tuple[bytes, bytes]]
    budget_warning: bool = False


_period_cache: list = [-1, ("", "")]


def _periods(now: float) -> tuple[str, str]:
    """(day, month) in UTC, recomputed once a minute."""
    minute = int(now // 60)
    if _period_cache[0] != minute:
        moment = datetime.fromtimestamp(now, timezone.utc)
        _period_cache[:] = [minute, (moment.strftime("%Y%m%d"), moment.strftime("%Y%m"))]
    return _period_cache[1]


def _seconds_until_refill(limit: float, current: float, previous: float, frac: float, extra: float) -> float:
    """How long until ``previous*(1-f) + current + extra <= limit`` holds again (sliding window)."""
    if previous > 0 and current + extra <= limit:
        needed = 1 - (limit - current - extra) / previous
        return max(0.0, (needed - frac) * 60)
    rest = (1 - frac) * 60  # this bucket ends; then the current one becomes "previous"
    if current <= 0:
        return rest
    needed = max(0.0, 1 - (limit - extra) / current)
    return rest + needed * 60


def _end_of_period(now: float, kind: str) -> float:
    moment = datetime.fromtimestamp(now, timezone.utc)
    if kind == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.timestamp() + 86400 - now
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp() - now


def rate_headers(plan: Plan, figures: list[int], frac: float) -> list[tuple[bytes, bytes]]:
    """The x-ratelimit-* headers: for requests and for tokens, the level with least left."""
    headers = []
    reset = f"{max(1, math.ceil((1 - frac) * 60))}s".encode()
    for index, (kind, attribute) in enumerate((("requests", "rpm"), ("tokens", "tpm"))):
        best = None
        for position, level in enumerate(plan.levels):
            limit = getattr(level, attribute)
            if not limit:
                continue
            used = figures[2 * position + index] / 1000 if 2 * position + index < len(figures) else 0
            remaining = max(0, limit - math.ceil(used - 1e-9))
            if best is None or remaining < best[1]:
                best = (limit, remaining)
        if best is not None:
            headers += [(f"x-ratelimit-limit-{kind}".encode(), str(best[0]).encode()),
                        (f"x-ratelimit-remaining-{kind}".encode(), str(best[1]).encode()),
                        (f"x-ratelimit-reset-{kind}".encode(), reset)]
    return headers


def _microseconds(now: float) -> str:
    """An injected clock's time as the scripts' last argument (in place of Redis's ``TIME``)."""
    return str(int(now * 1_000_000))


class Limiter:
    """The limits in Redis. ``clock`` (seconds since the epoch, e.g. ``time.time``) replaces Redis's
    ``TIME`` in the scripts: tests drive time with it. Without one (production), every process
    reads the one Redis clock."""

    def __init__(self, redis, lease_seconds: float, clock=None):
        self.redis = redis
        self.lease_ms = int(lease_seconds * 1000)
        self.clock = clock
        self._admit = redis.register_script(ADMIT) if redis is not None else None
        self._settle = redis.register_script(SETTLE) if redis is not None else None
        self._pending: list[tuple] = []
        self._flushing: asyncio.Task | None = None

    async def admit(self, plan: Plan, request_id: str) -> Admission:
        """Check and charge every level in one round trip; raise a 429 (with headers) when one refuses."""
        if plan.empty or self._admit is None:
            return Admission(headers=[])
        now = self.clock() if self.clock is not None else time.time()
        day, month = _periods(now)
        args = (request_id, self.lease_ms, day, month, plan.spec)
        if self.clock is not None:
            args += (_microseconds(now),)
        result = await self._admit(keys=(), args=args)
        return self._decide(plan, result, now)

    def _decide(self, plan: Plan, result: list, now: float) -> Admission:
        """ADMIT's answer (as the script returns it) as an admission, or the 429 to raise."""
        allowed, kind, index, current, previous, frac_micro, warn = result[:7]
        frac = frac_micro / 1_000_000
        headers = rate_headers(plan, result[7:], frac)
        if isinstance(kind, bytes):
            kind = kind.decode()
        if allowed == 1:
            return Admission(headers=headers, budget_warning=warn > 0)
        if kind == "concurrency":
            level = plan.levels[index - 1]
            error = ConcurrencyLimited(
                f"Too many requests at once for {level.name} {level.ident.split(':', 1)[1]} "
                f"(limit {level.concurrency}); retry when one finishes.",
                details={"level": level.name, "limit": level.concurrency})
            retry = 1.0
        elif kind == "budget":
            budget = plan.budgets[index - 1]
            error = BudgetExceeded(f"The token budget of {budget.path} is used up for this period.",
                                   details={"scope": budget.path, "daily": budget.daily, "monthly": budget.monthly})
            retry = _end_of_period(now, "day" if budget.daily else "month")
        else:
            level = plan.levels[index - 1]
            limit = level.rpm if kind == "rpm" else level.tpm
            what = "requests" if kind == "rpm" else "tokens"
            error = RateLimited(f"Rate limit of {limit} {what} per minute reached for {level.name} "
                                f"{level.ident.split(':', 1)[1]}.",
                                details={"level": level.name, "limit": limit, "per": "minute", "of": what})
            retry = _seconds_until_refill(limit, current, previous, frac, 1 if kind == "rpm" else 0)
        error.headers = headers + [(b"retry-after", str(max(1, math.ceil(retry))).encode())]
        raise error

    def settle(self, plan: Plan, request_id: str, tokens: int) -> None:
        """Release the concurrency lease and charge ``tokens``; queued and pipelined off the hot path."""
        if plan.empty or self._settle is None:
            return
        if not plan.settles:
            return
        now = self.clock() if self.clock is not None else time.time()
        day, month = _periods(now)
        args = (request_id, max(0, int(tokens or 0)), day, month, plan.spec)
        if self.clock is not None:
            args += (_microseconds(now),)
        self._pending.append(args)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the settlements of this loop turn gather first
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for args in batch:
                        await self._settle(keys=(), args=args, client=pipe)
                    await pipe.execute()
            except Exception:  # noqa: BLE001 - a lost settlement must not break serving; leases expire
                log.exception("could not settle %d gateway requests in Redis", len(batch))

    async def drain(self) -> None:
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)


class LocalLimiter(Limiter):
    """The same limits kept in this process, for the embedded mode (no ``REDIS_URL``): one process
    is the whole fleet there, so its own counters are exact. Same semantics as ``ADMIT``/``SETTLE``
    — sliding one-minute windows from two buckets, concurrency leases that expire, day and month
    budgets charged from real usage, hard or soft — and the same headers and refusals. Settling is
    immediate (no I/O). The clock is this process's ``time.time()``."""

    def __init__(self, lease_seconds: float, clock=time.time):
        self.lease_ms = int(lease_seconds * 1000)
        self.clock = clock
        self._counts: dict[str, int] = {}  # "<base>:r:<minute>", "<base>:t:<minute>", budget keys
        self._leases: dict[str, dict[str, int]] = {}  # "<base>:c" -> {request id: expiry ms}
        self._swept_minute = -1
        self._pending = []
        self._flushing = None

    def _sweep(self, minute: int, day: str, month: str) -> None:
        """Once a minute: forget buckets older than the previous minute and budgets of past periods."""
        self._swept_minute = minute
        recent = {str(minute), str(minute - 1)}
        for key in list(self._counts):
            _, kind, period = key.rsplit(":", 2)
            if (kind in ("r", "t") and period not in recent) or (kind == "d" and period != day) \
                    or (kind == "m" and period != month):
                del self._counts[key]
        for key in [key for key, leases in self._leases.items() if not leases]:
            del self._leases[key]

    def _evaluate(self, plan: Plan, request_id: str, now: float, day: str, month: str) -> list:
        """``ADMIT`` in Python: the same checks, charges and answer."""
        sec = int(now)
        now_ms = int(now * 1000)
        minute = sec // 60
        frac = (now % 60) / 60
        if minute != self._swept_minute:
            self._sweep(minute, day, month)
        counts = self._counts
        out = [1, "", 0, 0, 0, int(frac * 1_000_000), 0]
        figures = []
        for i, level in enumerate(plan.levels, start=1):
            base = f"{PREFIX}rl:{level.ident}"
            rc = rp = tc = tp = 0
            if level.rpm:
                rc = counts.get(f"{base}:r:{minute}", 0)
                rp = counts.get(f"{base}:r:{minute - 1}", 0)
                if out[0] == 1 and rp * (1 - frac) + rc + 1 > level.rpm:
                    out = [0, "rpm", i, rc, rp, out[5], 0]
            if level.tpm:
                tc = counts.get(f"{base}:t:{minute}", 0)
                tp = counts.get(f"{base}:t:{minute - 1}", 0)
                if out[0] == 1 and tp * (1 - frac) + tc >= level.tpm:
                    out = [0, "tpm", i, tc, tp, out[5], 0]
            if level.concurrency:
                leases = self._leases.get(f"{base}:c")
                if leases:
                    for rid in [rid for rid, until in leases.items() if until <= now_ms]:
                        del leases[rid]
                n = len(leases) if leases else 0
                if out[0] == 1 and n + 1 > level.concurrency:
                    out = [0, "concurrency", i, n, 0, out[5], 0]
            figures += [int((rp * (1 - frac) + rc) * 1000), int((tp * (1 - frac) + tc) * 1000)]
        warn = 0
        for j, budget in enumerate(plan.budgets, start=1):
            base = f"{PREFIX}budget:{budget.path}"
            over = ((budget.daily and counts.get(f"{base}:d:{day}", 0) >= budget.daily)
                    or (budget.monthly and counts.get(f"{base}:m:{month}", 0) >= budget.monthly))
            if over:
                if budget.hard:
                    if out[0] == 1:
                        out = [0, "budget", j, 0, 0, out[5], 0]
                else:
                    warn += 1
        out[6] = warn
        if out[0] == 1:
            for i, level in enumerate(plan.levels):
                base = f"{PREFIX}rl:{level.ident}"
                if level.rpm:
                    key = f"{base}:r:{minute}"
                    counts[key] = counts.get(key, 0) + 1
                    figures[2 * i] += 1000
                if level.concurrency:
                    self._leases.setdefault(f"{base}:c", {})[request_id] = now_ms + self.lease_ms
        return out + figures

    async def admit(self, plan: Plan, request_id: str) -> Admission:
        if plan.empty:
            return Admission(headers=[])
        now = self.clock()
        day, month = _periods(now)
        return self._decide(plan, self._evaluate(plan, request_id, now, day, month), now)

    def settle(self, plan: Plan, request_id: str, tokens: int) -> None:
        """``SETTLE`` in Python, at once: release the lease, charge the tokens."""
        if plan.empty or not plan.settles:
            return
        now = self.clock()
        day, month = _periods(now)
        minute = int(now) // 60
        tokens = max(0, int(tokens or 0))
        counts = self._counts
        for level in plan.levels:
            base = f"{PREFIX}rl:{level.ident}"
            if tokens and level.tpm:
                key = f"{base}:t:{minute}"
                counts[key] = counts.get(key, 0) + tokens
            if level.concurrency:
                leases = self._leases.get(f"{base}:c")
                if leases is not None:
                    leases.pop(request_id, None)
                    if not leases:
                        del self._leases[f"{base}:c"]
        if tokens:
            for budget in plan.budgets:
                base = f"{PREFIX}budget:{budget.path}"
                for key in (f"{base}:d:{day}", f"{base}:m:{month}"):
                    counts[key] = counts.get(key, 0) + tokens

    async def drain(self) -> None:
        return None
