"""The routing table: which replicas serve a model name now, and how to ask for a load.

The gateway reads this on every request, so it is built from two queries for the whole fleet and
kept in-process for ``ROUTING_TTL`` seconds (``GATEWAY_ROUTING_TTL``); a change published on
``CHANNEL`` (``publish_changed()``) makes every gateway process reload at once instead of waiting
for the TTL. Nothing here imports the gateway: the table is plain data.

How Serving keeps it current (the gateway calls both ends):

1. **Publish changes.** Call ``publish_changed()`` (after commit) whenever a replica enters or
   leaves the ``ready`` state or a deployment is created, parked, failed or removed, so routing
   follows within milliseconds rather than the TTL.
2. **Trigger loads.** ``request_load(model_name)`` is what the gateway calls when a request asks for
   a model that has no ready replica: a deployment on its way up is waited for; an on-demand model
   (``serving.ondemand``) is started or placed. It returns quickly (the agent loads) and is
   harmless when called many times. Anything that will not come up on its own raises
   ``ModelNotLoadable`` with the reason: the gateway answers it at once with 503 and no ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

from django.conf import settings
from django.utils import timezone

from berth.errors import Unavailable
from serving.keys import replica_key
from serving.catalog import profiles
from serving.catalog.models import ModelEntry
from serving.models import Deployment, DeploymentState, Replica

CHANNEL = "berth:routing:changed"

# Deployment states from which a model comes up by itself (or on request) without a person acting.
LOADABLE_STATES = frozenset({DeploymentState.PLANNED, DeploymentState.QUEUED, DeploymentState.STARTING,
                             DeploymentState.LOADING, DeploymentState.READY, DeploymentState.SLEEPING})
# Listed by /v1/models but routing nothing: a stopped or failed deployment still names its model.
LISTED_STATES = LOADABLE_STATES | {DeploymentState.STOPPING, DeploymentState.STOPPED, DeploymentState.FAILED}
# When a model's deployments disagree, the state shown is the most hopeful one.
_STATE_ORDER = [DeploymentState.READY, DeploymentState.LOADING, DeploymentState.STARTING, DeploymentState.QUEUED,
                DeploymentState.PLANNED, DeploymentState.SLEEPING, DeploymentState.STOPPING, DeploymentState.STOPPED,
                DeploymentState.FAILED]


class ModelNotLoadable(Unavailable):
    """The model will not come up on its own: answered at once, without ``Retry-After``."""

    code = "model_not_loaded"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    replica_id: str
    url: str  # http://host:port, no trailing slash
    key: str  # the per-replica engine key, sent as ``Authorization: Bearer``


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


@dataclasses.dataclass(frozen=True)
class LoadTicket:
    """A load is under way (or was asked for); ``expected_seconds`` is how long until it should be up."""

    model: str
    expected_seconds: float


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"http://{host}:{port}"


def _longest(contexts: list[int | None]) -> int | None:
    """The longest of the contexts, or None when any is not known (unknown is not a bound)."""
    return None if not contexts or None in contexts else max(contexts)


def load_table() -> RoutingTable:
    """Read the whole table: three indexed queries, whatever the fleet's size. A model answers to
    its catalog name and its aliases; an on-demand model with no deployment yet is listed too."""
    names: dict[str, dict] = {}
    for row in Deployment.objects.filter(state__in=LISTED_STATES).values("name", "task", "state", "engine", "config",
                                                                         "owner__path"):
        entry = names.setdefault(row["name"], {"task": row["task"], "states": set(), "contexts": [], "owners": set()})
        entry["states"].add(row["state"])
        entry["contexts"].append(profiles.running_context(row["engine"], row["config"]))
        entry["owners"].add(row["owner__path"])
    endpoints: dict[str, list[Endpoint]] = {}
    ready = (Replica.objects.filter(state=DeploymentState.READY, deployment__state__in=LOADABLE_STATES)
             .values_list("public_id", "port", "node__address", "deployment__name", "deployment__task"))
    for public_id, port, address, name, task in ready:
        endpoints.setdefault(name, []).append(Endpoint(str(public_id), _url(address, port), replica_key(public_id)))
        names.setdefault(name, {"task": task, "states": {DeploymentState.READY}, "contexts": [], "owners": set()})
    catalog = {row["name"]: row for row in ModelEntry.objects.values("name", "task", "aliases", "fallbacks",
                                                                     "scaling_min", "max_output_tokens", "profiles",
                                                                     "owner__path")}
    for name, row in catalog.items():
        # An on-demand model with no deployment yet is still routable: its first request loads it.
        if name not in names and row["scaling_min"] == 0:
            names[name] = {"task": row["task"], "states": {DeploymentState.STOPPED}, "contexts": [], "owners": set()}
    models = {}
    for name, entry in names.items():
        found = endpoints.get(name, [])
        states = entry["states"] | ({DeploymentState.READY} if found else set())
        state = next((s for s in _STATE_ORDER if s in states), DeploymentState.UNKNOWN)
        row = catalog.get(name) or {}
        # What runs bounds a request; before anything runs, what the catalog's profiles would run.
        contexts = entry["contexts"] or [profiles.running_context(profiles.engine(p), profiles.engine_config(p))
                                         for p in row.get("profiles") or ()
                                         if isinstance(p, dict) and profiles.engine(p) in profiles.ENGINE_KEYS]
        # The catalog says whose model it is; a model deployed by hand, its deployments, when they agree
        # (deployments of one name by several scopes, or by none, make it shared).
        owners = entry["owners"]
        owner = row["owner__path"] if row else (next(iter(owners)) if len(owners) == 1 else None)
        models[name] = ModelRoute(name=name, task=entry["task"], state=str(state), endpoints=tuple(found),
                                  fallbacks=tuple(f for f in row.get("fallbacks") or () if f != name),
                                  max_output_tokens=row.get("max_output_tokens"), context=_longest(contexts),
                                  owner=owner)
    for name, row in catalog.items():
        for alias in row["aliases"] or ():
            if name in models and alias not in models:
                models[alias] = models[name]  # the alias answers with the model's own route
    return RoutingTable(models=models, loaded_at=time.monotonic())


def _expected_load_seconds(deployments: list[Deployment]) -> float:
    """From how long this model's replicas took to become ready before, else the configured default,
    less what the current load has already spent."""
    default = float(getattr(settings, "GATEWAY_EXPECTED_LOAD_SECONDS", 60))
    past = list(Replica.objects.filter(deployment__in=deployments, ready_at__isnull=False, started_at__isnull=False)
                .order_by("-ready_at").values_list("started_at", "ready_at")[:10])
    typical = statistics.median([(ready - started).total_seconds() for started, ready in past]) if past else default
    started = (Replica.objects.filter(deployment__in=deployments, state__in=[DeploymentState.STARTING,
                                                                             DeploymentState.LOADING],
                                      started_at__isnull=False)
               .order_by("started_at").values_list("started_at", flat=True).first())
    elapsed = (timezone.now() - started).total_seconds() if started else 0.0
    return max(1.0, typical - elapsed)


def request_load(model_name: str) -> LoadTicket:
    """Ask for ``model_name`` to be made ready; return at once with the expected wait.

    Raises ``ModelNotLoadable`` (503, code ``model_not_loaded``) when nothing can bring it up.
    """
    from serving import ondemand

    deployments = [d for d in Deployment.objects.filter(name=model_name)]
    loadable = [d for d in deployments if d.state in LOADABLE_STATES]
    if not loadable:
        try:  # an on-demand model: its first request loads it (starting or placing a deployment)
            loadable = [ondemand.load(model_name)]
        except ondemand.NotLoadable as refusal:
            reason = refusal.message
            failed = [d for d in deployments if d.state == DeploymentState.FAILED]
            if failed and failed[0].state_detail and ondemand.entry_for(model_name) is None:
                reason = f"no deployment can serve it (last failure: {failed[0].state_detail[:200]})"
            raise ModelNotLoadable(f"{model_name} is not loaded and will not be: {reason}",
                                   details={"model": model_name, "reason": reason}) from None
    return LoadTicket(model=model_name, expected_seconds=_expected_load_seconds(loadable))


def publish_changed() -> None:
    """Tell every gateway process to reload the table now (call after commit). Best effort: the TTL
    catches a lost message."""
    url = getattr(settings, "REDIS_URL", None)
    if not url:
        return
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        try:
            client.publish(CHANNEL, b"1")
        finally:
            client.close()
    except redis.RedisError:
        pass


class RoutingCache:
    """The table as an asyncio process sees it: reloaded in a thread (``runner``) when older than
    ``ttl`` or when ``invalidate()`` was called (a published change); concurrent readers share one
    reload, and while it runs readers keep the previous table (only the very first read waits)."""

    def __init__(self, ttl: float, runner, loader=None):
        self.ttl = ttl
        self._runner = runner
        self._loader = loader or load_table  # a reader may load more with the table (``loader()`` calls it)
        self._table: RoutingTable | None = None
        self._stale = True
        self._reload = None
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

    async def changed(self, timeout: float) -> None:
        """Wait until the next reload finishes, or ``timeout``."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _start_reload(self):
        if self._reload is None or self._reload.done():
            self._stale = False
            self._reload = asyncio.get_running_loop().create_task(self._do_reload())
        return asyncio.shield(self._reload)

    async def _do_reload(self) -> RoutingTable:
        try:
            table = await self._runner(self._loader)
        except Exception:
            self._stale = True
            if self._table is not None:
                return self._table
            raise
        self._table = table
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return table
