"""The gateway's tracer on its own: W3C traceparent parsing, nothing recorded without an endpoint,
spans exported over OTLP/HTTP JSON to a real loopback receiver, and a collector that refuses or is
slower than the traffic costing dropped spans, never an error."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tracing import CLIENT, NOT_RECORDING, Tracer, parse_traceparent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def attributes(span: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


@pytest.mark.parametrize("value, expected", [
    (f"00-{TRACE}-{PARENT}-01", (TRACE, PARENT, True)),
    (f"00-{TRACE}-{PARENT}-00", (TRACE, PARENT, False)),
    (f" 00-{TRACE}-{PARENT}-01 ", (TRACE, PARENT, True)),
    (f"00-{'0' * 32}-{PARENT}-01", None),  # all-zero ids are invalid
    (f"00-{TRACE}-{'0' * 16}-01", None),
    (f"01-{TRACE}-{PARENT}-01", None),  # a version this parser does not know
    (f"00-{TRACE.upper()}-{PARENT}-01", None),  # W3C asks for lower-case hex
    ("garbage", None), ("", None), (None, None),
])
def test_traceparent_is_parsed_as_w3c_defines_it(value, expected):
    assert parse_traceparent(value) == expected


def test_without_an_endpoint_nothing_is_recorded():
    tracer = Tracer.from_environ({})
    assert not tracer.enabled
    span = tracer.start("POST /v1/chat/completions", f"00-{TRACE}-{PARENT}-01", request_id="req_1")
    assert span is NOT_RECORDING and span.child("authenticate") is NOT_RECORDING and span.traceparent is None
    span.set("http.response.status_code", 200)
    span.end()


def test_the_environment_is_read_as_opentelemetry_names_it():
    tracer = Tracer.from_environ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318/",
                                  "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc, x-team=ml",
                                  "OTEL_SERVICE_NAME": "gw-a", "OTEL_TRACES_SAMPLER_ARG": "0.5"})
    assert tracer.endpoint == "http://127.0.0.1:4318/v1/traces"
    assert tracer.headers["authorization"] == "Bearer abc" and tracer.headers["x-team"] == "ml"
    assert tracer.service == "gw-a" and tracer.ratio == 0.5
    exact = Tracer.from_environ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/traces",
                                 "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9/"})
    assert exact.endpoint == "http://127.0.0.1:4318/traces"
    with pytest.raises(ValueError, match="http"):
        Tracer.from_environ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "127.0.0.1:4318"})
    with pytest.raises(ValueError, match="SAMPLER_ARG"):
        Tracer.from_environ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_SAMPLER_ARG": "x"})


def test_spans_reach_the_collector_as_one_trace(receiver):
    async def scenario():
        tracer = Tracer(receiver.url, headers={"authorization": "Bearer collector-token"}, service="gw-test")
        tracer.begin()
        with tracer.start("POST /v1/chat/completions", f"00-{TRACE}-{PARENT}-01", **{"berth.request_id": "req_1"}) \
                as request:
            with request.child("authenticate"):
                pass
            with request.child("upstream", CLIENT, **{"server.port": 8080}) as upstream:
                sent_on = upstream.traceparent
            with pytest.raises(KeyError):
                with request.child("limits"):
                    raise KeyError("refused")
            request.set("http.response.status_code", 200)
        await tracer.close()
        return sent_on

    sent_on = asyncio.run(scenario())
    headers, _ = receiver.posts[0]
    assert headers["authorization"] == "Bearer collector-token" and headers["content-type"] == "application/json"
    spans = {span["name"]: span for span in receiver.spans()}
    assert set(spans) == {"POST /v1/chat/completions", "authenticate", "upstream", "limits"}
    root = spans["POST /v1/chat/completions"]
    assert root["traceId"] == TRACE and root["parentSpanId"] == PARENT and root["kind"] == 2
    assert root["_service"] == "gw-test"
    assert attributes(root) == {"berth.request_id": "req_1", "http.response.status_code": "200"}
    for name in ("authenticate", "upstream", "limits"):
        assert spans[name]["traceId"] == TRACE and spans[name]["parentSpanId"] == root["spanId"]
        assert int(spans[name]["startTimeUnixNano"]) >= int(root["startTimeUnixNano"])
        assert int(spans[name]["endTimeUnixNano"]) <= int(root["endTimeUnixNano"])
    assert spans["limits"]["status"]["code"] == 2 and "status" not in spans["authenticate"]
    assert sent_on == f"00-{TRACE}-{spans['upstream']['spanId']}-01"


def test_a_client_that_did_not_sample_is_followed():
    tracer = Tracer("http://127.0.0.1:9/v1/traces")
    assert tracer.start("POST /v1/completions", f"00-{TRACE}-{PARENT}-00") is NOT_RECORDING
    assert tracer.start("POST /v1/completions", None).recording
    assert Tracer("http://127.0.0.1:9/v1/traces", ratio=0.0).start("POST /v1/completions", None) is NOT_RECORDING


def test_a_refusing_collector_and_a_full_buffer_cost_spans_not_errors(receiver):
    async def scenario():
        tracer = Tracer(receiver.url, buffer=3, batch=10)
        tracer.begin()
        for n in range(5):
            tracer.start(f"request {n}", None).end()
        assert tracer.dropped == 2  # the buffer holds three
        receiver.status = 503
        await tracer.close()
        return tracer

    tracer = asyncio.run(scenario())
    assert tracer.dropped == 5 and receiver.posts == []
