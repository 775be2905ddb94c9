"""Who is calling: a key's principal, cached in-process so the hot path does not touch the database.

A key's plaintext is never kept: entries are indexed by a digest of it. On a miss the principal is
built in a database thread by Tenancy's single-lookup ``authenticate`` (plus one query for the
contracts up the tree) and kept ``GATEWAY_AUTH_CACHE_SECONDS``; refusals are kept as long, so a
flood of bad keys costs one lookup per key and window. Tenancy announces a key revoked, rotated
(its expiry moved) or its client deleted or changed (``tenancy.events``): the message drops the
key's entries at once in every process (``drop_lookup``), over Redis and, in the process that made
the change, directly — the embedded mode has no Redis. A load under way when the message arrives
serves only the requests that were already waiting for it: it is not kept, and a request arriving
later reads the key again. An expiry ends the entry when the key expires; a contract's limits
change within the window.

While the database cannot be reached (a read fails with a database error, not a refusal), a key read
before keeps its last reading for ``GATEWAY_AUTH_STALE_SECONDS`` past its expiry in the cache, as the
routing table keeps its previous copy: what the database said last still answers, and is asked again
at most once a second per key (a refusal is kept no longer than before). Revocations heard meanwhile still drop it at once, an expiring key
still ends when it expires, and a lost subscription still forgets everything. A key with no reading
that recent is answered 503 ``database_unavailable`` with ``Retry-After``, never 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time

from django.conf import settings
from django.db import InterfaceError, OperationalError

from berth.errors import BerthError
from gateway.batch import lines
from gateway.errors import DatabaseUnavailable
from gateway.limits import Budget, Level, Plan
from gateway.threads import run_db
from tenancy.services import clients, contracts

log = logging.getLogger(__name__)
# While the database refuses reads, a key's last reading answers this long before the next try: a flood
# of requests costs one connection attempt a second per key, not one each.
RETRY_SECONDS = 1.0
RETRY_AFTER_SECONDS = 5  # what a key that cannot be checked is told to wait
WARN_EVERY_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Principal:
    credential_pk: int
    credential_id: str
    key_prefix: str
    lookup: str
    client_pk: int
    client_id: str
    client_name: str
    project_pk: int
    project_path: str
    all_models: bool
    allowed_models: frozenset
    may_infer: bool
    environment: str
    plan: Plan
    priority: str = "normal"  # the client's workload priority: the order its requests wait in (gateway.slots)

    def allows(self, model: str) -> bool:
        return self.all_models or model in self.allowed_models


def load_principal(plaintext: str) -> tuple[Principal, float | None]:
    """(principal, expiry as a Unix time or None) for a key; raises Tenancy's refusals. Database."""
    return principal_of(clients.authenticate(plaintext))


BATCH = "batch:"  # what a batch's principal is cached under: "batch:<id>" (no key starts so)


def load_batch_principal(name: str) -> tuple[Principal, float | None]:
    """The principal of a batch's requests (``name`` is "batch:<id>"): its key's, at the batch priority
    (``gateway.batch.lines``). Database."""
    principal, expires_at = principal_of(lines.credential_of(name.removeprefix(BATCH)))
    return dataclasses.replace(principal, priority="batch"), expires_at


def principal_of(credential) -> tuple[Principal, float | None]:
    """(principal, expiry as a Unix time or None) of a credential already checked usable (with its
    client and project loaded). Database: the contracts up the tree."""
    client = credential.client
    project = client.project
    chain = {contract.scope.path: contract for contract in contracts.limit_chain(project)}
    levels = [Level("key", f"key:{credential.public_id}", credential.rpm_limit, credential.tpm_limit,
                    credential.concurrency_limit),
              Level("client", f"client:{client.public_id}", client.rpm_limit, client.tpm_limit,
                    client.concurrency_limit)]
    budgets = []
    kinds = ("project", "team", "org")
    for position, path in enumerate(project.ancestor_paths()):
        contract = chain.get(path)
        if contract is None:
            continue
        kind = kinds[position] if position < len(kinds) else "scope"
        levels.append(Level(kind, f"scope:{path}", contract.rpm_limit, contract.tpm_limit,
                            contract.concurrency_limit))
        budgets.append(Budget(path, contract.daily_token_budget, contract.monthly_token_budget,
                              contract.budget_mode == "hard", weekly=contract.weekly_token_budget))
    principal = Principal(
        credential_pk=credential.pk, credential_id=str(credential.public_id), key_prefix=credential.prefix,
        lookup=credential.lookup, client_pk=client.pk, client_id=str(client.public_id), client_name=client.name,
        project_pk=project.pk, project_path=project.path, all_models=client.all_models,
        allowed_models=frozenset(client.allowed_models), may_infer=client.may_infer,
        environment=client.environment, plan=Plan.build(levels, budgets), priority=client.priority)
    return principal, credential.expires_at.timestamp() if credential.expires_at else None


def _answer(value: Principal | BerthError) -> Principal:
    if isinstance(value, BerthError):
        raise value
    return value


class AuthCache:
    def __init__(self, ttl: float, max_entries: int = 100_000, stale: float | None = None):
        self.ttl = ttl
        # How long past its expiry here an entry may still answer while the database cannot be asked.
        self.stale = settings.GATEWAY_AUTH_STALE_SECONDS if stale is None else stale
        self.max_entries = max_entries
        # digest → (fresh until, kept until for a database outage, principal or refusal); monotonic times
        self._entries: dict[bytes, tuple[float, float, Principal | BerthError]] = {}
        self._by_lookup: dict[str, set[bytes]] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}
        # Bumped whenever what a load under way read may be stale (a key revoked or changed, a lost
        # subscription): a load begun before is answered but not kept.
        self._generation = 0
        self._warned_at = float("-inf")

    async def principal(self, plaintext: str, loader=load_principal) -> Principal:
        """The principal of a key (or, with ``load_batch_principal``, of a batch's requests)."""
        digest = hashlib.blake2b(plaintext.encode(), digest_size=16).digest()
        entry = self._entries.get(digest)
        now = time.monotonic()
        if entry is not None and entry[0] > now:
            return _answer(entry[2])
        pending = self._inflight.get(digest)
        if pending is None:
            pending = asyncio.get_running_loop().create_task(self._load(plaintext, digest, now, self._generation,
                                                                        loader))
            self._inflight[digest] = pending
            pending.add_done_callback(lambda done: self._inflight.get(digest) is done and self._inflight.pop(digest))
        return await asyncio.shield(pending)

    async def _load(self, plaintext: str, digest: bytes, started: float, generation: int, loader) -> Principal:
        try:
            principal, expires_at = await run_db(loader, plaintext)
        except BerthError as refusal:
            if generation == self._generation:
                # A refusal is not kept for an outage: a flood of bad keys must not pile up for minutes.
                self._store(digest, refusal, started + self.ttl, started + self.ttl, None)
            raise
        except (OperationalError, InterfaceError) as exc:  # the database is away (refusing, cut off): no verdict
            return self._last_reading(digest, exc)
        until = started + self.ttl
        kept = until + self.stale
        if expires_at is not None:
            ends = started + max(0.0, expires_at - time.time())
            until, kept = min(until, ends), min(kept, ends)  # an expired key is never served, stale or not
        if generation == self._generation:
            self._store(digest, principal, until, kept, principal.lookup)
        return principal

    def _last_reading(self, digest: bytes, exc: Exception) -> Principal:
        """The database could not be read: answer from the key's last reading while it may still be
        trusted (a revocation heard meanwhile has dropped it), else 503 with ``Retry-After``."""
        now = time.monotonic()
        entry = self._entries.get(digest)
        if entry is None or entry[1] <= now:
            raise DatabaseUnavailable("The database cannot be reached to check this API key; retry shortly.",
                                      retry_after=RETRY_AFTER_SECONDS) from exc
        _, kept, value = entry
        self._entries[digest] = (min(now + RETRY_SECONDS, kept), kept, value)  # asked again in a second
        if now - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = now
            log.warning("the database cannot be reached (%s: %s): API keys are served from their last reading, "
                        "each for at most %ss past it (BERTH_GATEWAY_AUTH_STALE_SECONDS)", type(exc).__name__,
                        str(exc).strip().splitlines()[0] if str(exc).strip() else "", self.stale)
        return _answer(value)

    def _store(self, digest: bytes, value, until: float, kept: float, lookup: str | None) -> None:
        """Keep ``value``: fresh until ``until``, and until ``kept`` for a database outage."""
        if kept <= time.monotonic():
            return  # nothing to keep (no cache lifetime and no stale window, or an expired key)
        if len(self._entries) >= self.max_entries:
            self.purge()
            if len(self._entries) >= self.max_entries:
                return
        self._entries[digest] = (until, kept, value)
        if lookup:
            self._by_lookup.setdefault(lookup, set()).add(digest)

    def purge(self) -> None:
        now = time.monotonic()
        for digest in [d for d, (_, kept, _) in self._entries.items() if kept <= now]:
            del self._entries[digest]
        for lookup in list(self._by_lookup):
            self._by_lookup[lookup] = {d for d in self._by_lookup[lookup] if d in self._entries}
            if not self._by_lookup[lookup]:
                del self._by_lookup[lookup]

    def drop_lookup(self, lookup: str) -> None:
        """A key was revoked (or changed): forget it now. Loads under way may have read it before
        (which of them are this key's is not known without its plaintext): none is kept, and a
        request from now on reads again rather than join one — a revocation is rare, a read cheap."""
        for digest in self._by_lookup.pop(lookup, ()):
            self._entries.pop(digest, None)
        self._forget_loads()

    def clear(self) -> None:
        """Forget everything, loads under way included (what was missed cannot be known)."""
        self._entries.clear()
        self._by_lookup.clear()
        self._forget_loads()

    def _forget_loads(self) -> None:
        self._generation += 1
        self._inflight.clear()
