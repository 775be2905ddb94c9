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
both engines is sent only to those that serve the route. The engine of each ready replica, and the
engines a model runs on (its deployments', or before it has any, its catalog profiles'), come with
Serving's routing table (``Endpoint.engine``, ``ModelRoute.engines``), so the hot path reads what
it already holds. An engine not known here is not refused: one that answers 404 for the route anyway
(another image tag, say) is refused the same way by the gateway.
"""

from __future__ import annotations

import dataclasses

from gateway.errors import RouteNotServed
from serving.control import routing
from serving.models import Deployment

NEWER = frozenset({"responses", "responses/input_tokens", "messages", "messages/count_tokens"})
SERVED = {"llamacpp": NEWER, "vllm": frozenset({"responses"})}  # of NEWER; the others are served by all
ENGINE_NAMES = dict(Deployment.Engine.choices)  # llamacpp -> llama.cpp, vllm -> vLLM


def serves(engine: str | None, endpoint: str) -> bool:
    """Whether ``engine`` serves ``endpoint`` (an engine not known here is not refused)."""
    return endpoint not in NEWER or engine not in SERVED or endpoint in SERVED[engine]


def engine_name(route: routing.ModelRoute, replica_id: str | None) -> str | None:
    """The engine's name (llama.cpp, vLLM) of the replica of ``route`` that answered."""
    kind = next((e.engine for e in route.endpoints if e.replica_id == replica_id), None)
    return ENGINE_NAMES.get(kind, kind) if kind else None


def refusal(model: str, endpoint: str, engines) -> RouteNotServed:
    names = sorted(ENGINE_NAMES.get(kind, kind) for kind in engines)
    serving = sorted(ENGINE_NAMES[kind] for kind, served in SERVED.items() if endpoint in served)
    return RouteNotServed(
        f"The model {model!r} runs on {' and '.join(names)}, which does not serve /v1/{endpoint} (served by "
        f"{' and '.join(serving)}); /v1/chat/completions serves it.",
        details={"model": model, "engine": names, "endpoint": f"/v1/{endpoint}"})


def narrowed(route: routing.ModelRoute, endpoint: str) -> routing.ModelRoute:
    """``route`` with only the ready replicas whose engine serves ``endpoint``; refused (400
    ``route_not_served``) when none does, or with none ready, when none of the model's engines does.
    Routes both engines serve come back as they are, at no cost."""
    if endpoint not in NEWER:
        return route
    if route.endpoints:
        kept = tuple(e for e in route.endpoints if serves(e.engine, endpoint))
        if len(kept) == len(route.endpoints):
            return route
        if kept:
            return dataclasses.replace(route, endpoints=kept)
        raise refusal(route.name, endpoint, {e.engine for e in route.endpoints})
    if route.engines and not any(serves(kind, endpoint) for kind in route.engines):
        raise refusal(route.name, endpoint, route.engines)
    return route
