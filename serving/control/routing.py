"""The routing table: which replicas serve a model name now (the gateway's read model).

The gateway reads this on every request, so it is built from three queries for the whole fleet and
kept in-process for ``ROUTING_TTL`` seconds (``GATEWAY_ROUTING_TTL``); a change published on
``serving.events.ROUTING_CHANNEL`` makes every gateway process reload at once instead of waiting for
the TTL. Nothing here imports the gateway: the table is plain data. Asking for a model with no
ready replica to be loaded is ``serving.control.ondemand.request_load``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time

from serving.catalog import profiles
from serving.engines.registry import ENGINES
from serving.keys import replica_key
from serving.models import Deployment, DeploymentState, ModelEntry, Replica
from serving.models.states import LISTED, LOADABLE, PRECEDENCE


@dataclasses.dataclass(frozen=True)
class Endpoint:
    replica_id: str
    url: str  # http://host:port, no trailing slash
    key: str  # the per-replica engine key, sent as ``Authorization: Bearer``
    engine: str = ""  # the engine kind it runs (``llamacpp``, ``vllm``): which API routes it serves
    slots: int = 1  # requests it serves at once (its engine's parallel slots)
    # It orders what it is sent by each request's ``priority`` (vLLM's priority scheduling policy).
    by_priority: bool = False


@dataclasses.dataclass(frozen=True)
class ModelRoute:
    name: str  # the catalog name, also when the request used an alias
    task: str
    state: str  # the most hopeful state among the model's deployments
    endpoints: tuple[Endpoint, ...]  # ready replicas
    fallbacks: tuple[str, ...] = ()  # models to serve instead while this one has no ready replica
    max_output_tokens: int | None = None  # the catalog's cap on one request's generated tokens; None: none
    context: int | None = None  # the longest context a replica of it runs (tokens); None: not known
    # The path of the scope whose model it is (its catalog entry's owner, else its deployments'): only
    # clients of that scope and below may call it, or see it listed. None: shared with every tenant.
    owner: str | None = None
    # The engine kinds it runs on (its coming-up and up deployments'), or before any, its catalog
    # profiles': a route none of them serves is refused before anything is loaded.
    engines: frozenset[str] = frozenset()

    # Read on every request: worked out once per route (a table's routes live until it is read again;
    # a narrowed copy works its own out).
    @functools.cached_property
    def slots(self) -> int:
        """Requests its ready replicas serve at once, together."""
        return sum(e.slots for e in self.endpoints)

    @functools.cached_property
    def by_priority(self) -> bool:
        """Whether every ready replica orders what it is sent by each request's ``priority``."""
        return bool(self.endpoints) and all(e.by_priority for e in self.endpoints)

    def admits(self, project_path: str) -> bool:
        """Whether a client of ``project_path`` may reach this model at all (before its own rules)."""
        return self.owner is None or project_path == self.owner or project_path.startswith(self.owner + "/")


@dataclasses.dataclass(frozen=True)
class RoutingTable:
    models: dict[str, ModelRoute]
    loaded_at: float  # time.monotonic()
    # Extra data a reader loads alongside (the gateway's model splits: name -> its splits); plain data.
    splits: dict = dataclasses.field(default_factory=dict)

    def route(self, name: str) -> ModelRoute | None:
        return self.models.get(name)


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"http://{host}:{port}"


def _longest(contexts: list[int | None]) -> int | None:
    """The longest of the contexts, or None when any is not known (unknown is not a bound)."""
    return None if not contexts or None in contexts else max(contexts)


def load_table() -> RoutingTable:
    """Read the whole table: three indexed queries, whatever the fleet's size. A model answers to
    its catalog name and its aliases; a catalog model with no deployment yet is listed too."""
    names: dict[str, dict] = {}
    for row in Deployment.objects.filter(state__in=LISTED).values("name", "task", "state", "engine", "config",
                                                                         "owner__path"):
        entry = names.setdefault(row["name"], {"task": row["task"], "states": set(), "contexts": [], "owners": set(),
                                               "engines": set()})
        entry["states"].add(row["state"])
        if row["state"] in LOADABLE:
            entry["engines"].add(row["engine"])
        entry["contexts"].append(profiles.running_context(row["engine"], row["config"]))
        entry["owners"].add(row["owner__path"])
    endpoints: dict[str, list[Endpoint]] = {}
    ready = (Replica.objects.filter(state=DeploymentState.READY, deployment__state__in=LOADABLE)
             .values_list("public_id", "port", "node__address", "deployment__name", "deployment__task",
                          "deployment__engine", "deployment__config"))
    for public_id, port, address, name, task, engine, config in ready:
        endpoints.setdefault(name, []).append(Endpoint(str(public_id), _url(address, port), replica_key(public_id),
                                                       engine, profiles.running_slots(engine, config),
                                                       (config or {}).get("scheduling_policy") == "priority"))
        names.setdefault(name, {"task": task, "states": {DeploymentState.READY}, "contexts": [], "owners": set(),
                                "engines": {engine}})
    catalog = {row["name"]: row for row in ModelEntry.objects.values("name", "task", "aliases", "fallbacks",
                                                                     "max_output_tokens", "profiles", "owner__path")}
    for name, row in catalog.items():
        # A catalog model with no deployment is still routable: an on-demand one's first request loads
        # it; an always-on one never placed (or parked) is answered at once with why (``request_load``).
        if name not in names:
            names[name] = {"task": row["task"], "states": {DeploymentState.STOPPED}, "contexts": [], "owners": set(),
                           "engines": set()}
    models = {}
    for name, entry in names.items():
        found = endpoints.get(name, [])
        states = entry["states"] | ({DeploymentState.READY} if found else set())
        state = next((s for s in PRECEDENCE if s in states), DeploymentState.UNKNOWN)
        row = catalog.get(name) or {}
        # What runs bounds a request; before anything runs, what the catalog's profiles would run.
        contexts = entry["contexts"] or [profiles.running_context(profiles.engine(p), profiles.engine_config(p))
                                         for p in row.get("profiles") or ()
                                         if isinstance(p, dict) and profiles.engine(p) in ENGINES]
        # The catalog says whose model it is; a model deployed by hand, its deployments, when they agree
        # (deployments of one name by several scopes, or by none, make it shared).
        owners = entry["owners"]
        owner = row["owner__path"] if row else (next(iter(owners)) if len(owners) == 1 else None)
        engines = entry["engines"] or {profiles.engine(p) for p in row.get("profiles") or () if isinstance(p, dict)}
        models[name] = ModelRoute(name=name, task=entry["task"], state=str(state), endpoints=tuple(found),
                                  fallbacks=tuple(f for f in row.get("fallbacks") or () if f != name),
                                  max_output_tokens=row.get("max_output_tokens"), context=_longest(contexts),
                                  owner=owner, engines=frozenset(engines))
    for name, row in catalog.items():
        for alias in row["aliases"] or ():
            if name in models and alias not in models:
                models[alias] = models[name]  # the alias answers with the model's own route
    return RoutingTable(models=models, loaded_at=time.monotonic())


class RoutingCache:
    """The table as an asyncio process sees it: reloaded in a thread (``runner``) when older than
    ``ttl`` or when ``invalidate()`` was called (a published change); concurrent readers share one
    reload, and while it runs readers keep the previous table (only the very first read waits).
    A name the table lacks is looked up again in a table read after the request arrived
    (``read_since``): without Redis nobody announces a change, and "does not exist" must not be a
    stale answer."""

    MISS_INTERVAL = 0.1  # reloads for names the table lacks: at most ten a second per process

    def __init__(self, ttl: float, runner, loader=None):
        self.ttl = ttl
        self._runner = runner
        self._loader = loader or load_table  # a reader may load more with the table (``loader()`` calls it)
        self._table: RoutingTable | None = None
        self._table_read_at = float("-inf")  # time.perf_counter() when the current table's read began
        self._stale = True
        self._reload = None
        self._reload_started = float("-inf")
        self._missed_at = float("-inf")  # when the last reload for a missing name began
        self._changed = asyncio.Event()

    def invalidate(self) -> None:
        self._stale = True

    async def get(self) -> RoutingTable:
        table = self._table
        if table is not None and not self._stale and time.monotonic() - table.loaded_at < self.ttl:
            return table
        reload = self._start_reload()
        if table is None:
            return await reload
        return table

    async def fresh(self) -> RoutingTable:
        """A table read after this call (waits for a reload)."""
        self._stale = True
        return await self._start_reload()

    async def read_since(self, moment: float) -> RoutingTable:
        """A table whose read began at or after ``moment`` (``time.perf_counter()``), for a name the
        current table lacks: the current one when it is that recent, else the reload in flight when it
        began late enough, else a new reload, at most one per ``MISS_INTERVAL`` (a caller waits that
        long rather than being told a just-deployed model does not exist). A reload that fails gives
        back the previous table."""
        while True:
            if self._table is not None and self._table_read_at >= moment:
                return self._table
            if self._reload is not None and not self._reload.done():
                if self._reload_started >= moment:
                    return await asyncio.shield(self._reload)
                await asyncio.wait([self._reload])  # began too early: wait it out, then read again
                continue
            pause = self._missed_at + self.MISS_INTERVAL - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)  # the rate bound on reloads for missing names
                continue
            self._missed_at = time.perf_counter()
            self._stale = True
            return await self._start_reload()

    async def changed(self, timeout: float) -> None:
        """Wait until the next reload finishes, or ``timeout``."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _start_reload(self):
        if self._reload is None or self._reload.done():
            self._stale = False
            self._reload_started = time.perf_counter()
            self._reload = asyncio.get_running_loop().create_task(self._do_reload(self._reload_started))
        return asyncio.shield(self._reload)

    async def _do_reload(self, started: float) -> RoutingTable:
        try:
            table = await self._runner(self._loader)
        except Exception:
            self._stale = True
            if self._table is not None:
                return self._table
            raise
        self._table, self._table_read_at = table, started
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return table
