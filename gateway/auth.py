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
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time

from berth.errors import BerthError
from gateway.limits import Budget, Level, Plan
from gateway.threads import run_db
from tenancy.services import clients, contracts


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

    def allows(self, model: str) -> bool:
        return self.all_models or model in self.allowed_models


def load_principal(plaintext: str) -> tuple[Principal, float | None]:
    """(principal, expiry as a Unix time or None) for a key; raises Tenancy's refusals. Database."""
    credential = clients.authenticate(plaintext)
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
                              contract.budget_mode == "hard"))
    principal = Principal(
        credential_pk=credential.pk, credential_id=str(credential.public_id), key_prefix=credential.prefix,
        lookup=credential.lookup, client_pk=client.pk, client_id=str(client.public_id), client_name=client.name,
        project_pk=project.pk, project_path=project.path, all_models=client.all_models,
        allowed_models=frozenset(client.allowed_models), may_infer=client.may_infer,
        environment=client.environment, plan=Plan.build(levels, budgets))
    return principal, credential.expires_at.timestamp() if credential.expires_at else None


class AuthCache:
    def __init__(self, ttl: float, max_entries: int = 100_000):
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[float, Principal | BerthError]] = {}
        self._by_lookup: dict[str, set[bytes]] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}
        # Bumped whenever what a load under way read may be stale (a key revoked or changed, a lost
        # subscription): a load begun before is answered but not kept.
        self._generation = 0

    async def principal(self, plaintext: str) -> Principal:
        digest = hashlib.blake2b(plaintext.encode(), digest_size=16).digest()
        entry = self._entries.get(digest)
        now = time.monotonic()
        if entry is not None and entry[0] > now:
            value = entry[1]
            if isinstance(value, BerthError):
                raise value
            return value
        pending = self._inflight.get(digest)
        if pending is None:
            pending = asyncio.get_running_loop().create_task(self._load(plaintext, digest, now, self._generation))
            self._inflight[digest] = pending
            pending.add_done_callback(lambda done: self._inflight.get(digest) is done and self._inflight.pop(digest))
        return await asyncio.shield(pending)

    async def _load(self, plaintext: str, digest: bytes, started: float, generation: int) -> Principal:
        try:
            principal, expires_at = await run_db(load_principal, plaintext)
        except BerthError as refusal:
            if generation == self._generation:
                self._store(digest, refusal, started + self.ttl, None)
            raise
        until = started + self.ttl
        if expires_at is not None:
            until = min(until, started + max(0.0, expires_at - time.time()))
        if generation == self._generation:
            self._store(digest, principal, until, principal.lookup)
        return principal

    def _store(self, digest: bytes, value, until: float, lookup: str | None) -> None:
        if self.ttl <= 0:
            return
        if len(self._entries) >= self.max_entries:
            self.purge()
            if len(self._entries) >= self.max_entries:
                return
        self._entries[digest] = (until, value)
        if lookup:
            self._by_lookup.setdefault(lookup, set()).add(digest)

    def purge(self) -> None:
        now = time.monotonic()
        for digest in [d for d, (until, _) in self._entries.items() if until <= now]:
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
