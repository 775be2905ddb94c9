"""Rate limits, concurrency and token budgets up the tenancy tree, in Redis, one round trip a request.

Each level (the client, its project, team and organisation; the key itself once keys carry limits)
has its own counters:

- requests and tokens per minute over an exact **sliding window**: a log of what the level was
  charged in the last 60 s (a sorted set scored by time; for tokens a running sum beside it). No
  60 s interval, wherever it starts, admits more requests than the limit. Tokens are known only
  once the answer is in (``SETTLE``), so a request is admitted while the tokens charged in the last
  60 s are under the limit, and the one that crosses it is served whole. Not GCRA or a token
  bucket: those admit a full burst and refill within the same minute (up to about twice the limit
  in 60 s) unless the burst is cut to a fraction of the limit. The log holds one entry per request
  of the last minute, so its size is bounded by what the level admits;
- concurrent requests as a sorted set of lease ids scored by a lease expiry, so a process that
  dies mid-request leaks nothing past the lease. A lease id is made per admission (a caller's
  ``X-Request-Id`` may repeat; two requests never share a lease);
- token budgets per scope and UTC day, ISO week (from Monday 00:00) and month, charged from real
  usage after each request; any of the three may be set on one scope, and budgets up the tree all
  apply. The tightest binds and is the one a refusal names: the period, of any budget on the way up,
  with the least room left (a period used up has none; of periods with equally little, the longest,
  since it binds the longest, and of those the nearest scope's). A hard budget cannot be
  overshot by requests in flight together: each admission *reserves* what the
  request may cost at most (its prompt, estimated, and the output it may produce: ``bodies.reservation``)
  as a hold beside the counter — a sorted set of ``<lease id>:<tokens>`` scored by the lease's
  expiry, so a process that dies mid-request holds nothing past its lease — and is admitted only
  while the counter, every hold and its own reservation fit; settling drops its hold and charges
  what it really used. A budget counter exists only once seeded from the usage records in the database (``UsageRecord``, the
  tokens of the scope's subtree in that period): when Redis has lost it (a restart that keeps
  nothing, an eviction), ``ADMIT`` answers which counters are missing, the gateway sums the
  records in a database thread and seeds each with ``SET NX`` (two processes seeding at once do not
  double it), then asks again. ``SETTLE`` charges only counters that exist. What a rebuilt counter
  can miss: the tokens of the last usage flush (``GATEWAY_USAGE_FLUSH_MS``) not yet written.

``ADMIT`` checks every level first and charges only when all pass, atomically (a Lua script), so the
combined rate of any number of gateway processes never passes a limit. Redis's own clock (``TIME``)
is the one clock, whatever the processes' clocks say (a test may inject one instead, as for
``LocalLimiter``: ``Limiter(redis, lease, clock=...)``, so it drives time rather than waits).
``SETTLE`` runs after the response: it releases the concurrency lease and charges the tokens;
settlements are pipelined in batches so they cost the hot path nothing.

When Redis does not answer in time (the gateway's client has ``BERTH_GATEWAY_REDIS_TIMEOUT_MS``), the
request is refused with 503 ``limiter_unavailable``, never served unlimited. A command that timed
out may still run once Redis wakes up, so ``REPAIR`` follows, retried until Redis answers: for an
admission, it voids the lease id (an ``ADMIT`` arriving later takes no lease) and releases the
lease; for a settlement, it releases the lease and drops the budget counters it would have charged
(they are rebuilt from the usage records, which hold those tokens).

Keys are built in the script from the bases in a per-key spec, not declared as KEYS: fine on one
Redis or a replicated one; Redis Cluster would need the bases hash-tagged to one slot and declared.
Scope paths are slugs, so the spec's separators never occur.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import math
import os
import time
from datetime import datetime, timedelta, timezone

from django.db.models import F, Sum
from django.db.models.functions import Coalesce

from gateway.errors import BudgetExceeded, ConcurrencyLimited, LimiterUnavailable, RateLimited
from gateway.models import UsageRecord
from gateway.threads import run_db
from tenancy.access import subtree

log = logging.getLogger(__name__)

PREFIX = "berth:gw:"
WINDOW_MS = 60_000
LOG_TTL_MS = 120_000  # a rate log outlives its last entry's minute; then Redis forgets an idle level
BUDGET_TTL = {"d": 2 * 86400 + 3600, "w": 8 * 86400 + 3600, "m": 32 * 86400 + 3600}  # seconds a budget counter is kept
PERIODS = ("d", "w", "m")  # a budget's periods, shortest first: its limits' order in the spec and ``Budget.limits``
PERIOD_NAMES = {"d": ("day", "daily"), "w": ("week", "weekly"), "m": ("month", "monthly")}
VOID_TTL_MS = 300_000  # a voided lease id is remembered this long (a stalled Redis runs late commands at once)
RETRY_WALK = 128  # a tokens refusal looks this far into the log for when it is under the limit again
REPAIRS_KEPT = 50_000  # repairs waiting for Redis; past that the oldest are dropped (their leases expire)

# ARGV: lease id, lease ms, day (YYYYMMDD), ISO week (YYYYWW), month (YYYYMM), spec, the tokens to
# reserve against hard budgets, and only with an injected clock the time in microseconds (else Redis's
# TIME). The spec is precomputed per key: "base,rpm,tpm,conc;..." for levels, then "|", then
# "budgetbase,daily,weekly,monthly,hard;..." (0 = none).
# Few arguments, because packing each one costs the gateway more than the script costs Redis.
# Answer: {status, kind, index, wait ms, warnings, then per level: requests in the window, ms until
# the window holds none of them, tokens in the window, ms until it holds none of them}; status 1
# admitted, 0 refused (kind and index say by what; wait: when every refusing rate admits again),
# 2 budget counters missing (then the rest names them: "<budget index><d|w|m>"), nothing charged. A
# budget refusal ends with two more: the tokens the tightest period has room for, and that period
# ("d"/"w"/"m"); the index is its budget's.
ADMIT = """
local sec, usec
if ARGV[8] then
  local us = tonumber(ARGV[8])
  sec = math.floor(us / 1000000)
  usec = us - sec * 1000000
else
  local t = redis.call('TIME')
  sec, usec = tonumber(t[1]), tonumber(t[2])
end
local now_ms = sec * 1000 + math.floor(usec / 1000)
local cutoff = now_ms - @WINDOW@
local lid, lease, spec = ARGV[1], tonumber(ARGV[2]), ARGV[6]
local kinds, periods = {'d', 'w', 'm'}, {ARGV[3], ARGV[4], ARGV[5]}
local reserve = tonumber(ARGV[7])
local bar = string.find(spec, '|', 1, true)
local levels, budgets = {}, {}
local leased = false
for base, rpm, tpm, conc in string.gmatch(string.sub(spec, 1, bar - 1), '([^,;]+),(%d+),(%d+),(%d+)') do
  levels[#levels + 1] = {base, tonumber(rpm), tonumber(tpm), tonumber(conc)}
  if tonumber(conc) > 0 then leased = true end
end
-- a budget: {its base, its limits per period (day, week, month; 0 = none), hard, its holds' key}
for base, daily, weekly, monthly, hard in
    string.gmatch(string.sub(spec, bar + 1), '([^,;]+),(%d+),(%d+),(%d+),(%d)') do
  budgets[#budgets + 1] = {base, {tonumber(daily), tonumber(weekly), tonumber(monthly)}, tonumber(hard), base .. ':h'}
end
local nl, nb = #levels, #budgets
-- Budget counters first: one that is missing (Redis lost it) is rebuilt from the usage records.
local spent, missing = {}, {}
for j = 1, nb do
  local b = budgets[j]
  spent[j] = {0, 0, 0}
  for p = 1, 3 do
    if b[2][p] > 0 then
      local count = redis.call('GET', b[1] .. ':' .. kinds[p] .. ':' .. periods[p])
      if count then spent[j][p] = tonumber(count) else missing[#missing + 1] = j .. kinds[p] end
    end
  end
end
if #missing > 0 then
  local out = {2, '', 0, 0, 0}
  for _, name in ipairs(missing) do out[#out + 1] = name end
  return out
end
if (leased or reserve > 0) and redis.call('EXISTS', '@PREFIX@void:' .. lid) == 1 then return {0, 'void', 0, 0, 0} end
local function tokens_of(member) return tonumber(string.match(member, ':(%d+)$')) end
local allowed, kind, index, wait = 1, '', 0, 0
local figures = {}
for i = 1, nl do
  local base, rpm, tpm, conc = levels[i][1], levels[i][2], levels[i][3], levels[i][4]
  local rn, tsum, treset = 0, 0, 0
  if rpm > 0 then
    local rk = base .. ':r'
    redis.call('ZREMRANGEBYSCORE', rk, '-inf', cutoff)
    rn = redis.call('ZCARD', rk)
    if rn + 1 > rpm then
      if allowed == 1 then allowed, kind, index = 0, 'rpm', i end
      -- one more fits once all but rpm - 1 of them have left: the (rn - rpm + 1)-th oldest
      local at = redis.call('ZRANGE', rk, rn - rpm, rn - rpm, 'WITHSCORES')
      wait = math.max(wait, tonumber(at[2]) - cutoff)
    end
  end
  if tpm > 0 then
    -- the log (member "<lease id>:<tokens>" scored by when charged) and beside it s: the tokens it
    -- holds, t: when the newest was charged (when t has left the window, all of them have)
    local tk, sk = base .. ':t', base .. ':ts'
    local state = redis.call('HMGET', sk, 's', 't')
    local newest = tonumber(state[2] or '0')
    if newest > cutoff then
      tsum = tonumber(state[1] or '0')
      local gone = redis.call('ZRANGEBYSCORE', tk, '-inf', cutoff)
      if #gone > 0 then
        local dropped = 0
        for _, member in ipairs(gone) do dropped = dropped + tokens_of(member) end
        redis.call('ZREMRANGEBYSCORE', tk, '-inf', cutoff)
        tsum = redis.call('HINCRBY', sk, 's', -dropped)
      end
      treset = newest - cutoff
      if tsum >= tpm then
        if allowed == 1 then allowed, kind, index = 0, 'tpm', i end
        -- under the limit once enough of the oldest have left (else, at the latest, once the newest has)
        local at, left = newest, tsum
        local oldest = redis.call('ZRANGE', tk, 0, @WALK@ - 1, 'WITHSCORES')
        for k = 1, #oldest, 2 do
          left = left - tokens_of(oldest[k])
          if left < tpm then at = tonumber(oldest[k + 1]); break end
        end
        wait = math.max(wait, at - cutoff)
      end
    end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', base .. ':c', '-inf', now_ms)
    local n = redis.call('ZCARD', base .. ':c')
    if allowed == 1 and n + 1 > conc then allowed, kind, index = 0, 'concurrency', i end
  end
  figures[#figures + 1] = rn
  figures[#figures + 1] = 0  -- (when its requests have all left: below)
  figures[#figures + 1] = math.max(0, tsum)
  figures[#figures + 1] = math.max(0, treset)
end
if allowed == 0 then  -- when each refused level's window is empty again (admitted: 60 s, set below)
  for i = 1, nl do
    if figures[4 * i - 3] > 0 then
      local newest = redis.call('ZRANGE', levels[i][1] .. ':r', -1, -1, 'WITHSCORES')
      figures[4 * i - 2] = tonumber(newest[2]) - cutoff
    end
  end
end
-- Hard budgets: what is spent, what the requests in flight hold and this one's reservation must fit
-- every period of every one. The tightest binds: the least room (none below none), of equals the
-- longest period (it binds the longest), of those the nearest scope's.
local warn, tight_room, tight_period, tight_index = 0, nil, 0, 0
for j = 1, nb do
  local b = budgets[j]
  if b[3] == 1 then
    redis.call('ZREMRANGEBYSCORE', b[4], '-inf', now_ms)
    local held = 0
    for _, member in ipairs(redis.call('ZRANGE', b[4], 0, -1)) do held = held + tokens_of(member) end
    for p = 3, 1, -1 do
      if b[2][p] > 0 then
        local room = math.max(0, b[2][p] - spent[j][p] - held)
        if tight_room == nil or room < tight_room or (room == tight_room and p > tight_period) then
          tight_room, tight_period, tight_index = room, p, j
        end
      end
    end
  else
    for p = 1, 3 do
      if b[2][p] > 0 and spent[j][p] >= b[2][p] then
        warn = warn + 1
        break
      end
    end
  end
end
if allowed == 1 and tight_room ~= nil and (tight_room <= 0 or reserve > tight_room) then
  allowed, kind, index = 0, 'budget', tight_index
end
if allowed == 1 then
  for i = 1, nl do
    local base = levels[i][1]
    if levels[i][2] > 0 then
      redis.call('ZADD', base .. ':r', now_ms, lid)
      redis.call('PEXPIRE', base .. ':r', @LOG_TTL@)
      figures[4 * i - 3] = figures[4 * i - 3] + 1
      figures[4 * i - 2] = @WINDOW@
    end
    if levels[i][4] > 0 then
      redis.call('ZADD', base .. ':c', now_ms + lease, lid)
      redis.call('PEXPIRE', base .. ':c', lease)
    end
  end
  if reserve > 0 then
    for j = 1, nb do
      if budgets[j][3] == 1 then
        redis.call('ZADD', budgets[j][4], now_ms + lease, lid .. ':' .. reserve)
        redis.call('PEXPIRE', budgets[j][4], lease)
      end
    end
  end
end
local out = {allowed, kind, index, math.max(0, wait), warn}
for _, v in ipairs(figures) do out[#out + 1] = v end
if kind == 'budget' then
  out[#out + 1] = tight_room
  out[#out + 1] = kinds[tight_period]
end
return out
"""

# ARGV: lease id, tokens, day, week, month, spec (as ADMIT's), the tokens its admission reserved, and
# the injected time as ADMIT's.
SETTLE = """
local now_ms
if ARGV[8] then
  now_ms = math.floor(tonumber(ARGV[8]) / 1000)
else
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local lid, tokens, day, week, month, spec = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local bar = string.find(spec, '|', 1, true)
for base, rpm, tpm, conc in string.gmatch(string.sub(spec, 1, bar - 1), '([^,;]+),(%d+),(%d+),(%d+)') do
  if tokens > 0 and tonumber(tpm) > 0 then
    local tk, sk = base .. ':t', base .. ':ts'
    local newest = tonumber(redis.call('HGET', sk, 't') or '0')
    if newest <= now_ms - @WINDOW@ then  -- all it holds has left the window: start again
      redis.call('DEL', tk)
      redis.call('HSET', sk, 's', tokens, 't', now_ms)
    else
      redis.call('HINCRBY', sk, 's', tokens)
      if now_ms > newest then redis.call('HSET', sk, 't', now_ms) end
    end
    redis.call('ZADD', tk, now_ms, lid .. ':' .. tokens)
    redis.call('PEXPIRE', tk, @LOG_TTL@)
    redis.call('PEXPIRE', sk, @LOG_TTL@)
  end
  if tonumber(conc) > 0 then redis.call('ZREM', base .. ':c', lid) end
end
local reserved = ARGV[7]
for base, hard in string.gmatch(string.sub(spec, bar + 1), '([^,;]+),%d+,%d+,%d+,(%d)') do
  if hard == '1' and reserved ~= '0' then redis.call('ZREM', base .. ':h', lid .. ':' .. reserved) end
  if tokens > 0 then
    -- a counter Redis lost is rebuilt from the usage records (this request's among them), not started here
    for _, k in ipairs({base .. ':d:' .. day, base .. ':w:' .. week, base .. ':m:' .. month}) do
      if redis.call('EXISTS', k) == 1 then redis.call('INCRBY', k, tokens) end
    end
  end
end
return 1
"""

# ARGV: lease id, spec, day, week, month, "1" to void the lease id (an admission that timed out), "1"
# to drop the budget counters (a settlement that may not have charged them), the tokens its admission
# reserved (its holds are dropped). Idempotent.
REPAIR = """
local lid, spec, day, week, month = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local bar = string.find(spec, '|', 1, true)
if ARGV[6] == '1' then redis.call('SET', '@PREFIX@void:' .. lid, 1, 'PX', @VOID_TTL@) end
for base, conc in string.gmatch(string.sub(spec, 1, bar - 1), '([^,;]+),%d+,%d+,(%d+)') do
  if tonumber(conc) > 0 then redis.call('ZREM', base .. ':c', lid) end
end
for base, hard in string.gmatch(string.sub(spec, bar + 1), '([^,;]+),%d+,%d+,%d+,(%d)') do
  if ARGV[7] == '1' then redis.call('DEL', base .. ':d:' .. day, base .. ':w:' .. week, base .. ':m:' .. month) end
  if hard == '1' and ARGV[8] ~= '0' then redis.call('ZREM', base .. ':h', lid .. ':' .. ARGV[8]) end
end
return 1
"""


def _script(text: str) -> str:
    return (text.replace("@PREFIX@", PREFIX).replace("@WINDOW@", str(WINDOW_MS))
            .replace("@LOG_TTL@", str(LOG_TTL_MS)).replace("@VOID_TTL@", str(VOID_TTL_MS))
            .replace("@WALK@", str(RETRY_WALK)))


ADMIT, SETTLE, REPAIR = _script(ADMIT), _script(SETTLE), _script(REPAIR)


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
    weekly: int | None = None  # (last, so that a budget of a day and a month reads as it always has)

    @property
    def limits(self) -> tuple[int | None, int | None, int | None]:
        """Per period of ``PERIODS``: day, week, month."""
        return self.daily, self.weekly, self.monthly

    def limit(self, kind: str) -> int | None:
        return self.limits[PERIODS.index(kind)]


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
                   budgets=tuple(b for b in budgets if any(b.limits)))

    @functools.cached_property
    def spec(self) -> str:
        levels = ";".join(f"{PREFIX}rl:{level.ident},{level.rpm or 0},{level.tpm or 0},{level.concurrency or 0}"
                          for level in self.levels)
        budgets = ";".join(f"{PREFIX}budget:{b.path},{b.daily or 0},{b.weekly or 0},{b.monthly or 0},"
                           f"{1 if b.hard else 0}" for b in self.budgets)
        return f"{levels}|{budgets}"

    @functools.cached_property
    def settles(self) -> bool:
        return bool(self.budgets) or any(level.tpm or level.concurrency for level in self.levels)

    @functools.cached_property
    def leased(self) -> bool:
        return any(level.concurrency for level in self.levels)

    @functools.cached_property
    def reserves(self) -> bool:
        """Whether an admission reserves its tokens: a hard budget applies."""
        return any(b.hard for b in self.budgets)


@dataclasses.dataclass
class Admission:
    headers: list[tuple[bytes, bytes]]
    budget_warning: bool = False


_period_cache: list = [-1, ("", "", "")]


def _periods(now: float) -> tuple[str, str, str]:
    """(day, ISO week, month) in UTC as budgets key them, recomputed once a minute."""
    minute = int(now // 60)
    if _period_cache[0] != minute:
        moment = datetime.fromtimestamp(now, timezone.utc)
        year, week, _ = moment.isocalendar()
        _period_cache[:] = [minute, (moment.strftime("%Y%m%d"), f"{year:04d}{week:02d}", moment.strftime("%Y%m"))]
    return _period_cache[1]


def period_bounds(period: str, kind: str) -> tuple[datetime, datetime]:
    """[start, end) in UTC of a day (``d``, ``YYYYMMDD``), an ISO week (``w``, ``YYYYWW``: the ISO
    year and week, Monday to Monday) or a month (``m``, ``YYYYMM``) as budgets key them."""
    if kind == "d":
        start = datetime.strptime(period, "%Y%m%d").replace(tzinfo=timezone.utc)
        return start, start + timedelta(days=1)
    if kind == "w":
        start = datetime.fromisocalendar(int(period[:4]), int(period[4:]), 1).replace(tzinfo=timezone.utc)
        return start, start + timedelta(days=7)
    start = datetime.strptime(period, "%Y%m").replace(tzinfo=timezone.utc)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def spent_in_database(path: str, since: datetime, until: datetime) -> int:
    """Tokens the usage records charge to ``path`` and its subtree for requests finished in
    [since, until): what a budget counter holds, rebuilt. Database."""
    tokens = Coalesce(F("prompt_tokens"), 0) + Coalesce(F("completion_tokens"), 0)
    total = (UsageRecord.objects.filter(subtree(path, "scope_path"), finished_at__gte=since, finished_at__lt=until)
             .aggregate(total=Sum(tokens))["total"])
    return int(total or 0)


def _end_of_period(now: float, kind: str) -> float:
    """Seconds from ``now`` to the end of its UTC ``day``, ISO ``week`` or ``month``."""
    moment = datetime.fromtimestamp(now, timezone.utc)
    if kind in ("day", "week"):
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        days = 1 if kind == "day" else 7 - moment.weekday()  # (Monday is 0)
        return start.timestamp() + days * 86400 - now
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp() - now


def rate_headers(plan: Plan, figures: list[int]) -> list[tuple[bytes, bytes]]:
    """The x-ratelimit-* headers: for requests and for tokens, the level with least left. Figures
    come four a level (as ``ADMIT`` answers): requests in the window, ms until none of them is,
    tokens in the window, ms until none of them is. ``remaining`` is what the window holds room
    for now; ``reset`` is when it is back to its initial state (all of its limit free), OpenAI's
    meaning, in whole seconds rounded up."""
    headers = []
    for kind, attribute, offset in (("requests", "rpm", 0), ("tokens", "tpm", 2)):
        best = None
        for position, level in enumerate(plan.levels):
            limit = getattr(level, attribute)
            at = 4 * position + offset
            if not limit or at + 1 >= len(figures):
                continue
            remaining = max(0, limit - int(figures[at]))
            if best is None or remaining < best[1]:
                best = (limit, remaining, int(figures[at + 1]))
        if best is not None:
            headers += [(f"x-ratelimit-limit-{kind}".encode(), str(best[0]).encode()),
                        (f"x-ratelimit-remaining-{kind}".encode(), str(best[1]).encode()),
                        (f"x-ratelimit-reset-{kind}".encode(), f"{math.ceil(max(0, best[2]) / 1000)}s".encode())]
    return headers


def _microseconds(now: float) -> str:
    """An injected clock's time as the scripts' last argument (in place of Redis's ``TIME``)."""
    return str(int(now * 1_000_000))


def _settlement_repair(lid: str, tokens: int, day: str, week: str, month: str, spec: str,
                       reserved: int) -> tuple | None:
    """``REPAIR``'s arguments for a settlement that may not have run (None when it had nothing to undo):
    release the lease and the hold, and drop the budget counters it charges, to be rebuilt from the
    usage records."""
    levels, budgets = spec.split("|", 1)
    leased = any(part.rsplit(",", 1)[1] != "0" for part in levels.split(";") if part)
    reseed = bool(tokens and budgets)
    if not (leased or reseed or reserved):
        return None
    return (lid, spec, day, week, month, "0", "1" if reseed else "0", str(reserved))


def limiter_client(url: str, timeout: float):
    """The limiter's Redis client: it fails fast. Connecting and each reply are bounded by ``timeout``
    (``BERTH_GATEWAY_REDIS_TIMEOUT_MS``), so a stalled Redis costs a request that long, not a hang;
    a connection found broken (Redis restarted) is retried once at once on a new one; a timeout is
    not retried (the command may still run: ``REPAIR`` covers it). Not for pub/sub, which waits."""
    # The Redis client is imported only here: the embedded mode (LocalLimiter) never loads it.
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry  # (as above: Redis only)
    from redis.backoff import NoBackoff  # (as above: Redis only)
    from redis.exceptions import ConnectionError as BrokenConnection  # (as above: Redis only)

    return aioredis.Redis.from_url(url, max_connections=256, health_check_interval=30, socket_timeout=timeout,
                                   socket_connect_timeout=timeout,
                                   retry=Retry(NoBackoff(), 1, supported_errors=(BrokenConnection,)))


class Limiter:
    """The limits in Redis. ``clock`` (seconds since the epoch, e.g. ``time.time``) replaces Redis's
    ``TIME`` in the scripts: tests drive time with it. Without one (production), every process
    reads the one Redis clock. ``spent(path, since, until)`` is what rebuilds a lost budget counter
    (run in a database thread; the usage records by default)."""

    def __init__(self, redis, lease_seconds: float, clock=None, spent=None):
        self.redis = redis
        self.lease_ms = int(lease_seconds * 1000)
        self.clock = clock
        self.spent = spent or spent_in_database
        self._admit = redis.register_script(ADMIT) if redis is not None else None
        self._settle = redis.register_script(SETTLE) if redis is not None else None
        self._repair = redis.register_script(REPAIR) if redis is not None else None
        self._setup()

    def _setup(self) -> None:
        self._pending: list[tuple] = []
        self._asking: list[tuple] = []  # (ADMIT's arguments, the future its answer goes to) of this turn
        self._flushing: asyncio.Task | None = None
        self._repairs: list[tuple] = []
        self._repairing: asyncio.Task | None = None
        self._seeding: dict[str, asyncio.Future] = {}
        self._held: dict[str, list[str]] = {}  # request id → lease ids admitted under it, not yet settled
        self._tag = os.urandom(4).hex()
        self._serial = itertools.count(1)

    def _lease_id(self) -> str:
        """Unique per admission across processes: a request id may repeat (callers may send their own)."""
        return f"{self._tag}{next(self._serial):x}"

    def _take_lease(self, plan: Plan, request_id: str) -> str:
        """The lease id a settlement releases: the one its admission took (any of them when a request
        id repeats; their leases are alike), or a fresh id where the plan holds no lease or hold."""
        if plan.leased or plan.reserves:
            held = self._held.get(request_id)
            if held:
                lid = held.pop()
                if not held:
                    del self._held[request_id]
                return lid
        return self._lease_id()

    async def admit(self, plan: Plan, request_id: str, reserve: int = 0) -> Admission:
        """Check and charge every level in one round trip; raise a 429 (with headers) when one refuses.
        ``reserve`` is what the request may cost at most, held against hard budgets until it settles
        (the same number goes to ``settle``)."""
        if plan.empty or self._admit is None:
            return Admission(headers=[])
        now = self.clock() if self.clock is not None else time.time()
        periods = _periods(now)
        lid = self._lease_id()
        reserve = reserve if plan.reserves else 0
        args = (lid, self.lease_ms, *periods, plan.spec, reserve)
        if self.clock is not None:
            args += (_microseconds(now),)
        try:
            result = await self._admit_together(args)
            if result[0] == 2:  # budget counters lost: rebuilt, then asked again
                await self._seed(plan, result[5:], periods)
                result = await self._admit_together(args)
                if result[0] == 2:
                    raise LimiterUnavailable("Token budgets cannot be checked right now; retry shortly.",
                                             retry_after=1)
        except BaseException as exc:
            if (plan.leased or reserve) and not isinstance(exc, LimiterUnavailable):
                # Timed out, cancelled or cut off: it may still run later. Void its lease id (and hold).
                self._queue_repairs([(lid, plan.spec, *periods, "1", "0", str(reserve))])
            raise
        admission = self._decide(plan, result, now, reserve)
        if plan.leased or reserve:
            self._held.setdefault(request_id, []).append(lid)
        return admission

    async def _admit_together(self, args: tuple) -> list:
        """ADMIT for one request, sent with those of every request that asks in the same turn of the
        event loop as one pipeline: a burst of requests costs one write and one read (and one pooled
        connection), not a command each queued on connections of their own."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._asking.append((args, answer))
        if len(self._asking) == 1:
            loop.create_task(self._send_asked())
        return await answer

    async def _send_asked(self) -> None:
        batch, self._asking = self._asking, []
        try:
            results = await self._pipelined(self._admit, [args for args, _ in batch], raise_on_error=False)
        except BaseException as exc:  # noqa: BLE001 - each request asking hears it (LimiterUnavailable there)
            for _, answer in batch:
                if not answer.done():
                    answer.cancel() if isinstance(exc, asyncio.CancelledError) else answer.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (_, answer), result in zip(batch, results):
            if not answer.done():  # (a request that gave up meanwhile voids its own lease: ``admit``)
                answer.set_exception(result) if isinstance(result, Exception) else answer.set_result(result)

    async def _pipelined(self, script, batch: list[tuple], raise_on_error: bool = True) -> list:
        """Run ``script`` once for each argument tuple of ``batch`` in one pipeline, by its SHA (a
        pipeline of registered scripts would ask ``SCRIPT EXISTS`` first: a round trip more); where
        Redis has lost the script (restarted empty), it is loaded and those calls sent again. With
        ``raise_on_error`` the first error of a call raises; else the errors are in the results."""
        from redis.exceptions import NoScriptError  # (Redis only: see ``limiter_client``)

        results: list = [None] * len(batch)
        todo = list(range(len(batch)))
        for attempt in (0, 1):
            async with self.redis.pipeline(transaction=False) as pipe:
                for index in todo:
                    pipe.evalsha(script.sha, 0, *batch[index])
                answers = await pipe.execute(raise_on_error=False)
            lost = []
            for index, answer in zip(todo, answers):
                results[index] = answer
                if isinstance(answer, NoScriptError):
                    lost.append(index)
            if not lost or attempt:
                break
            await self.redis.script_load(script.script)
            todo = lost
        if raise_on_error:
            for answer in results:
                if isinstance(answer, Exception):
                    raise answer
        return results

    async def _seed(self, plan: Plan, missing: list, periods: tuple[str, str, str]) -> None:
        """Rebuild the missing budget counters from the usage records, one database read per counter
        and process at a time (requests that find it missing meanwhile wait for the same read)."""
        jobs = []
        for name in missing:
            name = name.decode() if isinstance(name, bytes) else str(name)
            budget, kind = plan.budgets[int(name[:-1]) - 1], name[-1]
            period = periods[PERIODS.index(kind)]
            key = f"{PREFIX}budget:{budget.path}:{kind}:{period}"
            job = self._seeding.get(key)
            if job is None:
                job = asyncio.ensure_future(self._rebuild(key, budget.path, kind, period))
                self._seeding[key] = job
                job.add_done_callback(lambda _, key=key: self._seeding.pop(key, None))
            jobs.append(asyncio.shield(job))
        await asyncio.gather(*jobs)

    async def _rebuild(self, key: str, path: str, kind: str, period: str) -> None:
        since, until = period_bounds(period, kind)
        try:
            total = await run_db(self.spent, path, since, until)
        except Exception as exc:  # noqa: BLE001 - the database cannot say: refuse rather than forget a budget
            log.warning("could not rebuild the token budget counter of %s for %s: %s", path, period, exc)
            raise LimiterUnavailable(f"The token budget of {path} cannot be checked right now; retry shortly.",
                                     retry_after=5) from None
        log.info("rebuilt the token budget counter of %s for %s from the usage records: %d", path, period, total)
        await self._store_seed(key, total, kind)

    async def _store_seed(self, key: str, total: int, kind: str) -> None:
        # NX: another process may have seeded it (and charged it since); its count stands.
        await self.redis.set(key, total, nx=True, ex=BUDGET_TTL[kind])

    def _decide(self, plan: Plan, result: list, now: float, reserve: int = 0) -> Admission:
        """ADMIT's answer (as the script returns it) as an admission, or the error to raise."""
        allowed, kind, index, wait_ms, warn = result[:5]
        headers = rate_headers(plan, result[5:])
        if isinstance(kind, bytes):
            kind = kind.decode()
        if allowed == 1:
            return Admission(headers=headers, budget_warning=warn > 0)
        if kind == "void":  # only an admission given up on (and answered 503) long before meets this
            raise LimiterUnavailable("Rate limits cannot be checked right now; retry shortly.", retry_after=1)
        if kind == "concurrency":
            level = plan.levels[index - 1]
            error = ConcurrencyLimited(
                f"Too many requests at once for {level.name} {level.ident.split(':', 1)[1]} "
                f"(limit {level.concurrency}); retry when one finishes.",
                details={"level": level.name, "limit": level.concurrency})
            retry = 1.0
        elif kind == "budget":
            budget = plan.budgets[index - 1]  # the one with the tightest period (ADMIT chose it)
            room, code = result[5 + 4 * len(plan.levels):][:2]
            room, code = int(room), code.decode() if isinstance(code, bytes) else code
            period, adjective = PERIOD_NAMES[code]
            said = (f"The {adjective} token budget of {budget.path} is used up."
                    if room <= 0 else
                    f"The {adjective} token budget of {budget.path} has room for "
                    f"{room} tokens, counting what requests in flight may use; this one may use up to {reserve} "
                    "(its prompt and the output it asks for): ask for less output, or wait.")
            error = BudgetExceeded(said, details={
                "scope": budget.path, "daily": budget.daily, "weekly": budget.weekly, "monthly": budget.monthly,
                "budget": adjective, "limit": budget.limit(code), "period": period, "room": room,
                "reserved": reserve})
            # Used up: not before its period ends (of periods used up, it is the longest: ADMIT's choice).
            retry = _end_of_period(now, period) if room <= 0 else 1.0
        else:
            level = plan.levels[index - 1]
            limit = level.rpm if kind == "rpm" else level.tpm
            what = "requests" if kind == "rpm" else "tokens"
            error = RateLimited(f"Rate limit of {limit} {what} per minute reached for {level.name} "
                                f"{level.ident.split(':', 1)[1]}.",
                                details={"level": level.name, "limit": limit, "per": "minute", "of": what})
            retry = 0.0
        # No earlier than every refusing rate admits again (another level may refuse besides the one named).
        retry = max(retry, wait_ms / 1000)
        error.headers = headers + [(b"retry-after", str(max(1, math.ceil(retry))).encode())]
        raise error

    def settle(self, plan: Plan, request_id: str, tokens: int, reserved: int = 0) -> None:
        """Release the concurrency lease and the hold of ``reserved`` tokens, and charge ``tokens``;
        queued and pipelined off the hot path."""
        if plan.empty or self._settle is None:
            return
        if not plan.settles:
            return
        now = self.clock() if self.clock is not None else time.time()
        args = (self._take_lease(plan, request_id), max(0, int(tokens or 0)), *_periods(now), plan.spec,
                reserved if plan.reserves else 0)
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
                await self._pipelined(self._settle, batch)
            except Exception:  # noqa: BLE001 - a lost settlement must not break serving: repaired later
                log.exception("could not settle %d gateway requests in Redis; repairing when it answers", len(batch))
                # Whether they ran is unknown: release their leases and let the budgets they charge be
                # rebuilt from the usage records (charging again might count them twice).
                self._queue_repairs([repair for args in batch if (repair := _settlement_repair(*args[:7]))])

    def _queue_repairs(self, repairs: list[tuple]) -> None:
        self._repairs.extend(repairs)
        if len(self._repairs) > REPAIRS_KEPT:
            log.warning("dropped %d gateway lease repairs waiting for Redis (their leases expire)",
                        len(self._repairs) - REPAIRS_KEPT)
            del self._repairs[:-REPAIRS_KEPT]
        if self._repairing is None or self._repairing.done():
            self._repairing = asyncio.get_running_loop().create_task(self._repair_all())

    async def _repair_all(self) -> None:
        """Send the repairs until Redis answers, backing off while it does not."""
        delay = 0.5
        while self._repairs:
            await asyncio.sleep(delay)
            batch, self._repairs = self._repairs, []
            try:
                await self._pipelined(self._repair, batch)
            except Exception as exc:  # noqa: BLE001 - still unreachable: keep them, try again later
                self._repairs[:0] = batch
                del self._repairs[:-REPAIRS_KEPT]
                delay = min(delay * 2, 5.0)
                log.warning("could not repair %d gateway leases in Redis (%s); retrying", len(batch), exc)
                continue
            delay = 0.5
            log.info("repaired %d gateway leases in Redis", len(batch))

    async def drain(self) -> None:
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)

    async def aclose(self) -> None:
        """At shutdown: settlements sent, repairs given up (leases expire), the client closed."""
        await self.drain()
        if self._repairing is not None:
            self._repairing.cancel()
            await asyncio.gather(self._repairing, return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()


class LocalLimiter(Limiter):
    """The same limits kept in this process, for the embedded mode (no ``REDIS_URL``): one process
    is the whole fleet there, so its own counters are exact. Same semantics as ``ADMIT``/``SETTLE``
    — exact sliding one-minute logs, concurrency leases that expire, day, week and month budgets charged
    from real usage (rebuilt from the usage records when this process starts, as after a Redis
    loss), hard or soft — and the same headers and refusals. Settling is immediate (no I/O). The
    clock is this process's ``time.time()``."""

    def __init__(self, lease_seconds: float, clock=time.time, spent=None):
        self.lease_ms = int(lease_seconds * 1000)
        self.clock = clock
        self.spent = spent or spent_in_database
        self._requests: dict[str, collections.deque] = {}  # "<base>" → admission times (ms), oldest first
        self._tokens: dict[str, collections.deque] = {}  # "<base>" → (settle time ms, tokens), oldest first
        self._token_sums: dict[str, int] = {}
        self._leases: dict[str, dict[str, int]] = {}  # "<base>:c" → {lease id: expiry ms}
        self._budgets: dict[str, int] = {}  # "<base>:d:<day>", "<base>:w:<week>", "<base>:m:<month>" → tokens
        self._holds: dict[str, dict[str, tuple[int, int]]] = {}  # "<base>:h" → {lease id: (tokens, expiry ms)}
        self._swept_minute = -1
        self._setup()

    def _sweep(self, minute: int, cutoff: int, periods: tuple[str, str, str]) -> None:
        """Once a minute: forget logs with nothing in the window and budgets of past periods."""
        self._swept_minute = minute
        for base in [base for base, times in self._requests.items() if not times or times[-1] <= cutoff]:
            del self._requests[base]
        for base in [base for base, entries in self._tokens.items() if not entries or entries[-1][0] <= cutoff]:
            del self._tokens[base]
            self._token_sums.pop(base, None)
        current = dict(zip(PERIODS, periods))
        for key in list(self._budgets):
            _, kind, period = key.rsplit(":", 2)
            if period != current[kind]:
                del self._budgets[key]
        for key in [key for key, leases in self._leases.items() if not leases]:
            del self._leases[key]
        for key in [key for key, holds in self._holds.items() if not holds]:
            del self._holds[key]

    def _missing(self, plan: Plan, periods: tuple[str, str, str]) -> list[str]:
        missing = []
        for j, budget in enumerate(plan.budgets, start=1):
            base = f"{PREFIX}budget:{budget.path}"
            for kind, period, limit in zip(PERIODS, periods, budget.limits):
                if limit and f"{base}:{kind}:{period}" not in self._budgets:
                    missing.append(f"{j}{kind}")
        return missing

    async def _store_seed(self, key: str, total: int, kind: str) -> None:
        self._budgets.setdefault(key, total)

    def _evaluate(self, plan: Plan, lid: str, now: float, periods: tuple[str, str, str], reserve: int = 0) -> list:
        """``ADMIT`` in Python: the same checks, charges and answer."""
        now_ms = int(now * 1000)
        cutoff = now_ms - WINDOW_MS
        minute = int(now) // 60
        if minute != self._swept_minute:
            self._sweep(minute, cutoff, periods)
        allowed, kind, index, wait = 1, "", 0, 0
        figures: list[int] = []
        for i, level in enumerate(plan.levels, start=1):
            base = f"{PREFIX}rl:{level.ident}"
            rn = rreset = tsum = treset = 0
            if level.rpm:
                times = self._requests.get(base)
                while times and times[0] <= cutoff:
                    times.popleft()
                rn = len(times) if times else 0
                if rn:
                    rreset = times[-1] - cutoff
                if rn + 1 > level.rpm:
                    if allowed == 1:
                        allowed, kind, index = 0, "rpm", i
                    wait = max(wait, times[rn - level.rpm] - cutoff)
            if level.tpm:
                entries = self._tokens.get(base)
                while entries and entries[0][0] <= cutoff:
                    self._token_sums[base] -= entries.popleft()[1]
                if entries:
                    tsum = self._token_sums[base]
                    treset = entries[-1][0] - cutoff
                    if tsum >= level.tpm:
                        if allowed == 1:
                            allowed, kind, index = 0, "tpm", i
                        at, left = entries[-1][0], tsum
                        for at_ms, tokens in itertools.islice(entries, RETRY_WALK):
                            left -= tokens
                            if left < level.tpm:
                                at = at_ms
                                break
                        wait = max(wait, at - cutoff)
            if level.concurrency:
                leases = self._leases.get(f"{base}:c")
                if leases:
                    for held in [held for held, until in leases.items() if until <= now_ms]:
                        del leases[held]
                n = len(leases) if leases else 0
                if allowed == 1 and n + 1 > level.concurrency:
                    allowed, kind, index = 0, "concurrency", i
            figures += [rn, max(0, rreset), max(0, tsum), max(0, treset)]
        # Hard budgets: what is spent, what requests in flight hold and this reservation must fit every
        # period of every one; the tightest binds (as ADMIT: least room, then the longest period, then
        # the nearest scope).
        warn, tight = 0, None  # tight: (room, period's position in PERIODS, budget index)
        budgets = self._budgets
        for j, budget in enumerate(plan.budgets, start=1):
            base = f"{PREFIX}budget:{budget.path}"
            spent = [budgets.get(f"{base}:{kind}:{period}", 0) for kind, period in zip(PERIODS, periods)]
            if budget.hard:
                holds = self._holds.get(f"{base}:h", {})
                for held in [held for held, (_, until) in holds.items() if until <= now_ms]:
                    del holds[held]
                held = sum(tokens for tokens, _ in holds.values())
                for p in (2, 1, 0):
                    limit = budget.limits[p]
                    if limit:
                        room = max(0, limit - spent[p] - held)
                        if tight is None or room < tight[0] or (room == tight[0] and p > tight[1]):
                            tight = (room, p, j)
            elif any(limit and spent[p] >= limit for p, limit in enumerate(budget.limits)):
                warn += 1
        room_left = []
        if allowed == 1 and tight is not None and (tight[0] <= 0 or reserve > tight[0]):
            allowed, kind, index, room_left = 0, "budget", tight[2], [tight[0], PERIODS[tight[1]]]
        if allowed == 1:
            for i, level in enumerate(plan.levels):
                base = f"{PREFIX}rl:{level.ident}"
                if level.rpm:
                    self._requests.setdefault(base, collections.deque()).append(now_ms)
                    figures[4 * i] += 1
                    figures[4 * i + 1] = WINDOW_MS
                if level.concurrency:
                    self._leases.setdefault(f"{base}:c", {})[lid] = now_ms + self.lease_ms
            if reserve:
                for budget in plan.budgets:
                    if budget.hard:
                        self._holds.setdefault(f"{PREFIX}budget:{budget.path}:h", {})[lid] = \
                            (reserve, now_ms + self.lease_ms)
        return [allowed, kind, index, max(0, wait), warn] + figures + room_left

    async def admit(self, plan: Plan, request_id: str, reserve: int = 0) -> Admission:
        if plan.empty:
            return Admission(headers=[])
        now = self.clock()
        periods = _periods(now)
        missing = self._missing(plan, periods)
        if missing:  # this process has not counted them yet (it started since): from the usage records
            await self._seed(plan, missing, periods)
        lid = self._lease_id()
        reserve = reserve if plan.reserves else 0
        admission = self._decide(plan, self._evaluate(plan, lid, now, periods, reserve), now, reserve)
        if plan.leased or reserve:
            self._held.setdefault(request_id, []).append(lid)
        return admission

    def settle(self, plan: Plan, request_id: str, tokens: int, reserved: int = 0) -> None:
        """``SETTLE`` in Python, at once: release the lease and the hold, charge the tokens."""
        if plan.empty or not plan.settles:
            return
        now = self.clock()
        periods = _periods(now)
        now_ms = int(now * 1000)
        tokens = max(0, int(tokens or 0))
        lid = self._take_lease(plan, request_id)
        for level in plan.levels:
            base = f"{PREFIX}rl:{level.ident}"
            if tokens and level.tpm:
                self._tokens.setdefault(base, collections.deque()).append((now_ms, tokens))
                self._token_sums[base] = self._token_sums.get(base, 0) + tokens
            if level.concurrency:
                leases = self._leases.get(f"{base}:c")
                if leases is not None:
                    leases.pop(lid, None)
                    if not leases:
                        del self._leases[f"{base}:c"]
        if reserved and plan.reserves:
            for budget in plan.budgets:
                holds = self._holds.get(f"{PREFIX}budget:{budget.path}:h")
                if holds is not None:
                    holds.pop(lid, None)
        if tokens:
            budgets = self._budgets
            for budget in plan.budgets:
                base = f"{PREFIX}budget:{budget.path}"
                for key in (f"{base}:{kind}:{period}" for kind, period in zip(PERIODS, periods)):
                    if key in budgets:  # (one not counted yet is rebuilt from the records, this one's included)
                        budgets[key] += tokens

    async def drain(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
