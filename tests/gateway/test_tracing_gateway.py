"""A gateway process with a trace collector configured: each request is a server span continuing
the client's ``traceparent``, with children for authentication, limits and the upstream attempt,
and the engine is sent the attempt's own ``traceparent``. Without a collector the client's trace
context still reaches the engine unchanged (the gateway records nothing)."""

from __future__ import annotations

import httpx
import pytest

from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess
from tests.assets.recording_engine import RecordingEngine

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def traced_gateway(receiver, artifacts_dir, transactional_db):
    process = GatewayProcess(artifacts_dir / "gateway-traced.log",
                             environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
                                      "OTEL_SERVICE_NAME": "berth-gateway-test"})
    yield process
    process.stop()


@pytest.fixture
def hop(tiny_engine, deploy):
    engine = RecordingEngine(tiny_engine.server.base_url)
    deploy("traced-tiny", replica_id=tiny_engine.replica_id, port=engine.port, task="completion")
    yield engine
    engine.close()


def complete(gateway, key, **headers):
    response = httpx.post(f"{gateway.base_url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}", **headers},
                          json={"model": "traced-tiny", "prompt": "a", "max_tokens": 2})
    assert response.status_code == 200, response.text
    return response


def test_a_request_is_one_trace_from_the_client_to_the_engine(traced_gateway, receiver, hop, make_key):
    response = complete(traced_gateway, make_key().key, traceparent=f"00-{TRACE}-{CLIENT_SPAN}-01")
    request_id = response.headers["x-request-id"]
    spans = wait_until(lambda: {s["name"]: s for s in receiver.spans()} if len(receiver.spans()) >= 4 else None,
                       15, what="the request's spans at the collector")
    root = spans["POST /v1/completions"]
    assert root["traceId"] == TRACE and root["parentSpanId"] == CLIENT_SPAN and root["_service"] == "berth-gateway-test"
    attributes = {a["key"]: next(iter(a["value"].values())) for a in root["attributes"]}
    assert attributes["berth.request_id"] == request_id and attributes["http.response.status_code"] == "200"
    assert attributes["gen_ai.request.model"] == "traced-tiny" and int(attributes["gen_ai.usage.output_tokens"]) > 0
    for child in ("authenticate", "limits", "upstream"):
        assert spans[child]["traceId"] == TRACE and spans[child]["parentSpanId"] == root["spanId"]
    sent = hop.last("/v1/completions")["headers"]
    assert sent["traceparent"] == f"00-{TRACE}-{spans['upstream']['spanId']}-01"


def test_an_untraced_gateway_passes_the_clients_context_on_and_drops_a_bad_one(gateway, hop, make_key):
    key = make_key().key
    complete(gateway, key, traceparent=f"00-{TRACE}-{CLIENT_SPAN}-01")
    assert hop.last("/v1/completions")["headers"]["traceparent"] == f"00-{TRACE}-{CLIENT_SPAN}-01"
    complete(gateway, key, traceparent="00-not-a-trace-01")
    assert "traceparent" not in hop.last("/v1/completions")["headers"]
