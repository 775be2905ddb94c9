"""Prometheus metrics of the gateway. The ``model`` label is always a catalog model name (one the
routing table knows) or ``unknown`` — never a string a client sent, so nobody can grow the series."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

registry = CollectorRegistry(auto_describe=True)

REQUESTS = Counter("berth_gateway_requests", "Requests through /v1/, by model, endpoint and status.",
                   ["model", "endpoint", "status"], registry=registry)
LATENCY = Histogram("berth_gateway_request_seconds", "Time from request to the last byte sent.",
                    ["model", "endpoint"], registry=registry,
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
TTFT = Histogram("berth_gateway_first_token_seconds", "Time to the first streamed chunk.", ["model"],
                 registry=registry, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
QUEUE = Histogram("berth_gateway_queue_seconds", "Time waiting for a replica (admission while loading).",
                  ["model"], registry=registry, buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120))
WAITING = Gauge("berth_gateway_waiting", "Requests waiting now for a model to load (admission queue).", ["model"],
                registry=registry)
TOKENS = Counter("berth_gateway_tokens", "Tokens processed, by model and kind (prompt, completion).",
                 ["model", "kind"], registry=registry)


def render() -> bytes:
    return generate_latest(registry)
