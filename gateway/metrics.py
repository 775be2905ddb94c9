"""Prometheus metrics of the gateway. The ``model`` label is always a catalog model name (one the
routing table knows) or ``unknown`` — never a string a client sent, so nobody can grow the series."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest

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
SLOT_WAITING = Gauge("berth_gateway_slot_waiting", "Requests waiting now for a slot of a model whose replicas are "
                     "all busy (served in priority order).", ["model"], registry=registry)
TOKENS = Counter("berth_gateway_tokens", "Tokens processed, by model and kind (prompt, completion).",
                 ["model", "kind"], registry=registry)



# The same figures under the OpenTelemetry GenAI semantic conventions' names (dots become
# underscores in Prometheus), duplicated at scrape time: the series above keep their names.
TOKEN_TYPE = {"prompt": "input", "completion": "output"}  # gen_ai.token.type's values


def _genai_labels(labels: dict) -> dict:
    out = {"gen_ai_request_model": labels["model"]}
    if "endpoint" in labels:
        out["gen_ai_operation_name"] = labels["endpoint"]
    if "kind" in labels:
        out["gen_ai_token_type"] = TOKEN_TYPE.get(labels["kind"], labels["kind"])
    if "le" in labels:
        out["le"] = labels["le"]
    return out


class GenAINames:
    """Re-exposes LATENCY, TTFT and TOKENS as gen_ai_server_request_duration,
    gen_ai_server_time_to_first_token and gen_ai_client_token_usage (seconds and tokens)."""

    SOURCES = ((LATENCY, "gen_ai_server_request_duration", "GenAI: time from request to the last byte (s)."),
               (TTFT, "gen_ai_server_time_to_first_token", "GenAI: time to the first streamed chunk (s)."),
               (TOKENS, "gen_ai_client_token_usage", "GenAI: tokens processed, by gen_ai_token_type."))

    def collect(self):
        for source, name, doc in self.SOURCES:
            for family in source.collect():
                out = Metric(name, doc, family.type)
                for sample in family.samples:
                    suffix = sample.name[len(family.name):]
                    if suffix != "_created":
                        out.add_sample(out.name + suffix, _genai_labels(sample.labels), sample.value)
                yield out


registry.register(GenAINames())


def render() -> bytes:
    return generate_latest(registry)
