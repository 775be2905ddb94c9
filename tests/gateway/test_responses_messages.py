"""OpenAI's Responses API and Anthropic's Messages API through the gateway, with the official `openai` and
`anthropic` clients, unchanged, against a real llama-server (SmolLM2): usage from each API's own shape,
errors in each API's own shape, `x-api-key`, the output cap in each API's field, tools and structured
outputs passed through untouched, and a route an engine does not serve refused with the engine named."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from berth.errors import BerthError
from gateway.app import error_body, stream_error
from gateway.errors import BudgetExceeded
from serving import events
from serving.models import Deployment, ModelEntry
from tests.assets.recording_engine import RecordingEngine
from tests.gateway.usage import record_of

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]

QUESTION = "What is the capital of France? One word."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
               "additionalProperties": False}


def claude(gateway, key, **options):
    return anthropic.Anthropic(api_key=key, base_url=gateway.base_url, max_retries=0, timeout=120, **options)


@pytest.fixture
def recorded(chat_engine, deploy):
    """``recorded(name)``: a model whose one replica is the SmolLM2 engine seen through a ``RecordingEngine``.
    Give each test a name of its own: a name the gateway's table lacks is read afresh, while a known
    name may be served once more from the table read before (here: the previous test's hop, closed)."""
    made = []

    def make(name, missing=()):
        hop = RecordingEngine(chat_engine.server.base_url, missing)
        made.append(hop)
        deploy(name, replica_id=chat_engine.replica_id, port=hop.port)
        return hop

    yield make
    for hop in made:
        hop.close()


# --- the Responses API ----------------------------------------------------------------------------------

def test_responses_answer_through_the_openai_client_with_usage_recorded(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    caller = make_key()
    raw = gateway.openai(caller.key).responses.with_raw_response.create(
        model="smollm2", input=QUESTION, max_output_tokens=12, temperature=0, extra_headers={"X-Request-Id": "resp-1"})
    assert raw.headers["x-request-id"] == "resp-1"
    answer = raw.parse()
    assert "paris" in answer.output_text.lower()
    record = record_of("resp-1")
    assert (record.endpoint, record.status, record.model_served, record.stream) == ("responses", 200, "smollm2", False)
    assert record.prompt_tokens == answer.usage.input_tokens > 0
    assert record.completion_tokens == answer.usage.output_tokens > 0
    assert record.client_id == caller.client.pk


def test_responses_stream_and_usage_comes_from_the_completed_event(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    events_seen = list(gateway.openai(make_key().key).responses.create(
        model="smollm2", input="Count from one to five.", max_output_tokens=16, temperature=0, stream=True,
        extra_headers={"X-Request-Id": "resp-stream-1"}))
    kinds = [event.type for event in events_seen]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 2
    usage = events_seen[-1].response.usage
    record = record_of("resp-stream-1")
    assert record.stream and record.status == 200 and record.endpoint == "responses"
    assert (record.prompt_tokens, record.completion_tokens) == (usage.input_tokens, usage.output_tokens)
    assert record.ttft_ms is not None and record.ttft_ms <= record.total_ms


def test_responses_input_tokens_counts_and_charges_no_tokens(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    counted = gateway.openai(make_key().key).responses.input_tokens.with_raw_response.count(
        model="smollm2", input=QUESTION, extra_headers={"X-Request-Id": "resp-count-1"})
    assert counted.parse().input_tokens > 0
    record = record_of("resp-count-1")
    assert record.endpoint == "responses/input_tokens" and record.status == 200
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)  # no model ran


def test_responses_errors_are_openais_shape(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    key = make_key().key
    response = httpx.post(f"{gateway.base_url}/v1/responses", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          json={"model": "smollm2", "input": 5})
    assert response.status_code == 400
    assert response.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                           "code": "invalid_request", "param": "input"}


# --- Anthropic's Messages API ---------------------------------------------------------------------------

def test_messages_answer_through_the_anthropic_client(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    caller = make_key()
    raw = claude(gateway, caller.key).messages.with_raw_response.create(
        model="smollm2", max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}],
        extra_headers={"X-Request-Id": "msg-1"})
    assert raw.http_request.headers["anthropic-version"]
    message = raw.parse()
    assert message.type == "message" and "paris" in message.content[0].text.lower()
    record = record_of("msg-1")
    assert (record.endpoint, record.status, record.model_served) == ("messages", 200, "smollm2")
    # Anthropic's input_tokens leave out what its cache read: the record counts the whole prompt.
    assert record.prompt_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    assert record.completion_tokens == message.usage.output_tokens > 0
    assert record.credential_id == caller.credential.pk


def test_messages_stream_anthropics_event_types_and_usage(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    stream = claude(gateway, make_key().key).messages.create(
        model="smollm2", max_tokens=16, extra_body={"temperature": 0}, stream=True,
        messages=[{"role": "user", "content": "Count from one to five."}], extra_headers={"X-Request-Id": "msg-s-1"})
    seen = list(stream)
    kinds = [event.type for event in seen]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert "".join(e.delta.text for e in seen if e.type == "content_block_delta").strip()
    start, delta = seen[0].message.usage, seen[-2].usage
    record = record_of("msg-s-1")
    assert record.stream and record.status == 200 and record.endpoint == "messages"
    assert record.prompt_tokens == start.input_tokens + (start.cache_read_input_tokens or 0)
    assert record.completion_tokens == delta.output_tokens > 0


def test_messages_count_tokens(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    counted = claude(gateway, make_key().key).messages.with_raw_response.count_tokens(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], extra_headers={"X-Request-Id": "msg-c-1"})
    assert counted.parse().input_tokens > 0
    record = record_of("msg-c-1")
    assert record.endpoint == "messages/count_tokens" and (record.prompt_tokens, record.completion_tokens) == (0, 0)


def test_messages_refusals_are_anthropics_shape_with_berths_codes(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    key = make_key().key
    with pytest.raises(anthropic.AuthenticationError) as refused:
        claude(gateway, "brk_0123456789ab_" + "y" * 43).messages.create(
            model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"] | {"message": ""} == {"type": "authentication_error", "code": "invalid_api_key",
                                                             "message": ""}
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude(gateway, key).messages.create(model="no-such-model", max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["code"] == "model_not_found"
    # Anthropic requires max_tokens; so does the gateway (no key needed to be told).
    missing = httpx.post(f"{gateway.base_url}/v1/messages", headers={"x-api-key": key}, timeout=30,
                         json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
    body = missing.json()
    assert missing.status_code == 400 and body["type"] == "error"
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "invalid_request_error", "invalid_request", "max_tokens")
    nobody = httpx.post(f"{gateway.base_url}/v1/messages/count_tokens", timeout=30, json={"model": "smollm2"})
    assert nobody.status_code == 401 and nobody.json()["error"]["code"] == "missing_api_key"
    assert "x-api-key" in nobody.json()["error"]["message"]
    wrong_method = httpx.get(f"{gateway.base_url}/v1/messages", timeout=30)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_the_engines_own_refusal_on_messages_is_reshaped_as_anthropics(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    with pytest.raises(anthropic.BadRequestError) as refused:  # llama.cpp: a prompt longer than its context (1024)
        claude(gateway, make_key().key).messages.create(
            model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "the sea " * 1500}])
    body = refused.value.body  # llama.cpp answers in OpenAI's shape; the client gets Anthropic's
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "context" in body["error"]["message"]


def test_x_api_key_is_accepted_on_every_route_and_a_bearer_still_wins(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    key = make_key().key
    # As Anthropic's clients (before 2.x) and the tools built on them send it: x-api-key and anthropic-version.
    with httpx.stream("POST", f"{gateway.base_url}/v1/messages", timeout=60,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                      json={"model": "smollm2", "max_tokens": 3, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"] == "text/event-stream"
        lines = [line for line in streamed.iter_lines() if line.startswith("event: ")]
    assert lines[0] == "event: message_start" and lines[-1] == "event: message_stop"
    models = httpx.get(f"{gateway.base_url}/v1/models", headers={"x-api-key": key}, timeout=30)
    assert models.status_code == 200 and "smollm2" in [m["id"] for m in models.json()["data"]]
    chat = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"x-api-key": key}, timeout=60,
                      json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    both = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60,
                      headers={"x-api-key": key, "Authorization": "Bearer brk_0123456789ab_" + "z" * 43},
                      json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert both.status_code == 401 and both.json()["error"]["code"] == "invalid_api_key"


# --- what passes through, and the output cap in each API's field ----------------------------------------

def test_tools_and_tool_choice_pass_through_every_api_untouched(gateway, recorded, make_key):
    engine = recorded("rec-tools")
    key = make_key().key
    # SmolLM2's template has no tools, so it answers in text: what matters is that the engine got the
    # tools as sent, and that what it answered reached the client unchanged.
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                    "parameters": WEATHER_SCHEMA}}]
    chat = gateway.openai(key).chat.completions.with_raw_response.create(
        model="rec-tools", max_tokens=8, temperature=0, tools=chat_tools, tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    sent = engine.last("/v1/chat/completions")
    assert (sent["body"]["tools"], sent["body"]["tool_choice"]) == (chat_tools, "required")
    assert chat.http_response.content == sent["answer"]

    response_tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                       "parameters": WEATHER_SCHEMA, "strict": True}]
    answer = gateway.openai(key).responses.with_raw_response.create(
        model="rec-tools", input="What is the weather in Paris?", max_output_tokens=8, temperature=0,
        tools=response_tools, tool_choice={"type": "function", "name": "get_weather"})
    sent = engine.last("/v1/responses")
    assert sent["body"]["tools"] == response_tools
    assert sent["body"]["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert answer.http_response.content == sent["answer"]

    message_tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}]
    message = claude(gateway, key).messages.with_raw_response.create(
        model="rec-tools", max_tokens=8, extra_body={"temperature": 0}, tools=message_tools, tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    sent = engine.last("/v1/messages")
    assert (sent["body"]["tools"], sent["body"]["tool_choice"]) == (message_tools, {"type": "any"})
    assert message.http_response.content == sent["answer"]
    assert message.parse().content  # the anthropic client reads what came back


def test_a_json_schema_response_format_reaches_the_engine_and_shapes_the_answer(gateway, recorded, make_key):
    engine = recorded("rec-json")
    key = make_key().key
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    chat = gateway.openai(key).chat.completions.create(
        model="rec-json", max_tokens=40, temperature=0, response_format=response_format,
        messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}])
    assert engine.last("/v1/chat/completions")["body"]["response_format"] == response_format
    assert set(json.loads(chat.choices[0].message.content)) == {"city"}  # the engine's grammar held it to the schema
    # The Responses API's `text.format` is passed on as sent (llama.cpp's conversion does not read it).
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}}
    answer = gateway.openai(key).responses.with_raw_response.create(
        model="rec-json", input="Which city is the capital of France?", max_output_tokens=8, text=text)
    sent = engine.last("/v1/responses")
    assert sent["body"]["text"] == text and answer.http_response.content == sent["answer"]


def test_the_models_cap_is_sent_in_each_apis_own_field(gateway, recorded, make_key):
    ModelEntry.objects.create(name="rec-capped", task="chat", source_kind="local", source_path="/m.gguf", format="gguf",
                              max_output_tokens=3, profiles=[{"name": "cpu", "engine": "llamacpp", "file": "/m.gguf"}])
    engine = recorded("rec-capped")
    key = make_key().key
    answer = gateway.openai(key).responses.create(model="rec-capped", input="Tell me a long story.",
                                                  extra_body={"ignore_eos": True})
    sent = engine.last("/v1/responses")["body"]
    assert sent["max_output_tokens"] == 3 and "max_tokens" not in sent
    assert answer.usage.output_tokens == 3
    for field in ("max_output_tokens", "max_tokens", "n_predict"):  # each reaches llama.cpp through Responses
        refused = httpx.post(f"{gateway.base_url}/v1/responses", headers={"Authorization": f"Bearer {key}"},
                             timeout=30, json={"model": "rec-capped", "input": "hi", field: 4})
        assert refused.status_code == 400
        assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == ("max_tokens_above_cap", field)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(gateway, key).messages.create(model="rec-capped", max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["code"] == "max_tokens_above_cap"
    assert len([c for c in engine.calls if c["path"] == "/v1/messages"]) == 0  # refused before the engine


# --- routes an engine does not serve --------------------------------------------------------------------

def as_vllm(made):
    Deployment.objects.filter(pk=made.deployment.pk).update(engine="vllm")
    events.routing_changed()


def test_a_route_the_models_engine_does_not_serve_is_400_naming_it_before_any_limit(gateway, chat_engine, deploy,
                                                                                     make_key):
    as_vllm(deploy("on-vllm", chat_engine))  # vLLM v0.11 serves /v1/responses, not Anthropic's routes
    caller = make_key(rpm_limit=1)
    for path, body in (("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses/input_tokens", {"input": "hi"})):
        refused = httpx.post(f"{gateway.base_url}{path}", headers={"x-api-key": caller.key}, timeout=30,
                             json={"model": "on-vllm", **body})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "route_not_served" and "vLLM" in error["message"]
        assert error["details"] == {"model": "on-vllm", "engine": ["vLLM"], "endpoint": path}
    assert "type" not in refused.json()  # /v1/responses/input_tokens answers in OpenAI's shape
    # None of those spent the one request a minute: the Responses API, which vLLM serves, goes through.
    served = gateway.openai(caller.key).responses.create(model="on-vllm", input="hi", max_output_tokens=2)
    assert served.status == "completed"


def test_a_model_not_running_yet_is_judged_by_its_engines(gateway, deploy, make_key):
    ModelEntry.objects.create(name="vllm-someday", task="chat", source_kind="local", source_path="/m", format="gguf",
                              profiles=[{"name": "gpu", "engine": "vllm", "file": "/m"}])
    as_vllm(deploy("vllm-starting", state="starting"))
    key = make_key().key
    for model in ("vllm-someday", "vllm-starting"):
        with pytest.raises(anthropic.BadRequestError) as refused:  # at once: nothing is loaded for it
            claude(gateway, key).messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body["error"]["code"] == "route_not_served"
        assert refused.value.body["error"]["details"]["engine"] == ["vLLM"]


def test_an_engine_answering_404_for_a_route_is_refused_with_its_name_not_a_5xx(gateway, recorded, make_key):
    recorded("rec-404", missing=("/v1/responses",))
    response = httpx.post(f"{gateway.base_url}/v1/responses", headers={"Authorization": f"Bearer {make_key().key}"},
                          timeout=30, json={"model": "rec-404", "input": "hi", "max_output_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "route_not_served" and error["details"]["engine"] == ["llama.cpp"]


# --- the shapes, as functions ---------------------------------------------------------------------------

def test_error_and_stream_error_shapes_per_api():
    refused = BudgetExceeded("over", details={"scope": "a"})
    assert json.loads(error_body(refused, anthropic=True)) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "over", "code": "budget_exceeded",
                                   "details": {"scope": "a"}}}
    broken = BerthError("broke", code="upstream_error", status=502)
    assert stream_error("messages", broken).startswith(b"event: error\ndata: {\"type\":\"error\",\"error\":")
    event = stream_error("responses", broken)
    assert event.startswith(b"event: error\ndata: ")
    assert json.loads(event.split(b"data: ", 1)[1]) == {"type": "error", "code": "upstream_error", "message": "broke",
                                                        "param": None}
    assert stream_error("chat/completions", broken) == b"data: " + error_body(broken) + b"\n\n"
