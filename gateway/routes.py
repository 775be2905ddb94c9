"""Which API routes each engine serves, checked before a request is sent to one.

Chat completions, completions, embeddings and rerank are served by both engines. The newer routes
are not; what the versions Berth runs serve, read in their sources:

- llama-server, built from the llama.cpp tree vendored in llama-cpp-python 0.3.36
  (``serving.engines.build_llamacpp``): ``tools/server/server.cpp`` registers ``/v1/responses``,
  ``/v1/responses/input_tokens``, ``/v1/messages`` and ``/v1/messages/count_tokens``;
- vLLM v0.11.0 (``serving.engines.vllm.DEFAULT_IMAGE_TAG``): its OpenAI server serves
  ``/v1/responses`` (and retrieving or cancelling a stored response), not
  ``/v1/responses/input_tokens``; Anthropic's Messages API came to vLLM in a later release.

A request for a route that none of the model's engines serves is refused with 400
``route_not_served`` naming the engine, before any limit is spent; a model with ready replicas on
both engines is sent only to those that serve the route. What engine each ready replica runs, and
what engines each model runs on (its deployments', or before it has any, its catalog profiles'), is
loaded with the routing table (``load_table``), so the hot path reads two dicts. An engine not
known here (or a replica read between the table's queries) is not refused: an engine that answers
404 for the route anyway (another image tag, say) is refused the same way by the gateway.
"""

from __future__ import annotations

import dataclasses

from gateway import splits
from gateway.errors import RouteNotServed
from serving.catalog import profiles
from serving.control import routing
from serving.models import Deployment, DeploymentState, ModelEntry, Replica
from serving.models.states import LOADABLE

NEWER = frozenset({"responses", "responses/input_tokens", "messages", "messages/count_tokens"})
SERVED = {"llamacpp": NEWER, "vllm": frozenset({"responses"})}  # of NEWER; the others are served by all
ENGINE_NAMES = dict(Deployment.Engine.choices)  # llamacpp -> llama.cpp, vllm -> vLLM


@dataclasses.dataclass(frozen=True)
class Table(routing.RoutingTable):
    """Serving's routing table with the engines the gateway loads alongside."""

    replica_engines: dict = dataclasses.field(default_factory=dict)  # ready replica id -> engine kind
    model_engines: dict = dataclasses.field(default_factory=dict)  # model name -> frozenset of engine kinds


def load_table() -> Table:
    """The table the gateway's ``RoutingCache`` loads: Serving's, the splits, and the engines (two
    more queries for the whole fleet, and the catalog's profiles)."""
    table = splits.load_table()
    replicas = {str(public_id): engine for public_id, engine in
                Replica.objects.filter(state=DeploymentState.READY, deployment__state__in=LOADABLE)
                .values_list("public_id", "deployment__engine")}
    models: dict[str, set] = {}
    for name, engine in Deployment.objects.filter(state__in=LOADABLE).values_list("name", "engine").distinct():
        models.setdefault(name, set()).add(engine)
    for name, entry_profiles in ModelEntry.objects.values_list("name", "profiles"):
        if name not in models:  # not deployed yet: the engines its profiles would run
            kinds = {profiles.engine(p) for p in entry_profiles or () if isinstance(p, dict)}
            if kinds:
                models[name] = kinds
    fields = {field.name: getattr(table, field.name) for field in dataclasses.fields(routing.RoutingTable)}
    return Table(**fields, replica_engines=replicas, model_engines={n: frozenset(k) for n, k in models.items()})


def serves(engine: str | None, endpoint: str) -> bool:
    """Whether ``engine`` serves ``endpoint`` (an engine not known here is not refused)."""
    return endpoint not in NEWER or engine not in SERVED or endpoint in SERVED[engine]


def engine_name(table: routing.RoutingTable, replica_id: str | None) -> str | None:
    kind = getattr(table, "replica_engines", {}).get(replica_id)
    return ENGINE_NAMES.get(kind, kind) if kind else None


def refusal(model: str, endpoint: str, engines) -> RouteNotServed:
    names = sorted(ENGINE_NAMES.get(kind, kind) for kind in engines)
    serving = sorted(ENGINE_NAMES[kind] for kind, served in SERVED.items() if endpoint in served)
    return RouteNotServed(
        f"The model {model!r} runs on {' and '.join(names)}, which does not serve /v1/{endpoint} (served by "
        f"{' and '.join(serving)}); /v1/chat/completions serves it.",
        details={"model": model, "engine": names, "endpoint": f"/v1/{endpoint}"})


def narrowed(table: routing.RoutingTable, route: routing.ModelRoute, endpoint: str) -> routing.ModelRoute:
    """``route`` with only the ready replicas whose engine serves ``endpoint``; refused (400
    ``route_not_served``) when none does, or with none ready, when none of the model's engines does.
    Routes both engines serve come back as they are, at no cost."""
    if endpoint not in NEWER:
        return route
    replica_engines = getattr(table, "replica_engines", {})
    if route.endpoints:
        kept = tuple(e for e in route.endpoints if serves(replica_engines.get(e.replica_id), endpoint))
        if len(kept) == len(route.endpoints):
            return route
        if kept:
            return dataclasses.replace(route, endpoints=kept)
        raise refusal(route.name, endpoint, {replica_engines[e.replica_id] for e in route.endpoints})
    engines = getattr(table, "model_engines", {}).get(route.name)
    if engines and not any(serves(kind, endpoint) for kind in engines):
        raise refusal(route.name, endpoint, engines)
    return route
