"""The official openai client, unchanged, against a real gateway process and real llama-server replicas."""

import httpx
import pytest

from tests.assets.waiting import wait_until
from tests.gateway.usage import record_of

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def test_chat_answers_through_the_gateway_and_leaves_a_usage_record(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    caller = make_key()
    client = gateway.openai(caller.key)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France? One word."}],
        max_tokens=12, temperature=0, extra_headers={"X-Request-Id": "chat-test-1"})
    assert raw.headers["x-request-id"] == "chat-test-1"
    answer = raw.parse()
    assert "paris" in answer.choices[0].message.content.lower()
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    record = record_of("chat-test-1")
    assert (record.status, record.model_asked, record.model_served) == (200, "smollm2", "smollm2")
    assert str(record.replica_id) == chat_engine.replica_id
    assert record.prompt_tokens == answer.usage.prompt_tokens
    assert record.completion_tokens == answer.usage.completion_tokens
    assert record.client_id == caller.client.pk and record.scope_path == caller.client.project.path
    assert record.credential_id == caller.credential.pk and record.key_prefix == caller.credential.prefix
    assert record.total_ms > 0 and not record.stream


def test_chat_streams_and_usage_is_known_without_asking(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    client = gateway.openai(make_key().key)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Count from one to five."}], max_tokens=16,
        temperature=0, stream=True, extra_headers={"X-Request-Id": "chat-stream-1"})
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 2 and "".join(pieces).strip()
    record = record_of("chat-stream-1")
    assert record.stream and record.status == 200
    assert record.completion_tokens and record.prompt_tokens  # from the usage chunk the gateway asked for
    assert record.ttft_ms is not None and record.ttft_ms <= record.total_ms


def test_served_requests_measure_the_speed_of_the_profile_they_ran_on(gateway, chat_engine, deploy, make_key):
    from serving.models import ProfileSpeed
    from serving.models import Deployment

    made = deploy("smollm2", chat_engine)
    Deployment.objects.filter(pk=made.deployment.pk).update(profile="cpu")  # as the catalog deploys it
    client = gateway.openai(make_key().key)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=24,
        temperature=0, stream=True, extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "speed-1"})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices).strip()
    record = record_of("speed-1")  # the speed is noted before the batch is written
    measured = ProfileSpeed.objects.get(model="smollm2", profile="cpu")
    assert record.completion_tokens == 24 and measured.requests == 1 and measured.tokens == 23  # after the first
    assert measured.seconds == pytest.approx((record.total_ms - record.ttft_ms) / 1000, rel=1e-6)
    assert measured.tokens_per_second > 0


def test_completions_stream_and_not(gateway, tiny_engine, deploy, make_key):
    deploy("tiny", tiny_engine, task="completion")
    client = gateway.openai(make_key().key)
    whole = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny", prompt="the", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert any(chunk.usage and chunk.usage.completion_tokens == 5 for chunk in chunks)


def test_embeddings(gateway, embedding_engine, deploy, make_key):
    deploy("tiny-embed", embedding_engine, task="embedding")
    client = gateway.openai(make_key().key)
    result = client.embeddings.create(model="tiny-embed", input=["hello world", "the world"])
    assert len(result.data) == 2 and len(result.data[0].embedding) == 64
    assert result.usage.prompt_tokens > 0


def test_models_lists_only_what_the_key_may_use_with_state(gateway, tiny_engine, deploy, make_key):
    deploy("tiny", tiny_engine, task="completion")
    deploy("coming-up", state="loading")
    deploy("secret-model", state="loading")
    client = gateway.openai(make_key(all_models=False, allowed_models=["tiny", "coming-up"]).key)

    def listed():
        return {model.id: model.model_extra["state"] for model in client.models.list()}

    wait_until(lambda: listed() == {"tiny": "ready", "coming-up": "loading"}, 10, what="the listed models")


def test_the_request_id_reaches_the_engine_and_a_bad_one_is_replaced(gateway, tiny_engine, deploy, make_key):
    deploy("tiny", tiny_engine, task="completion")
    key = make_key().key
    response = httpx.post(f"{gateway.base_url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}", "X-Request-Id": "bad id\twith spaces"},
                          json={"model": "tiny", "prompt": "a", "max_tokens": 1})
    assert response.status_code == 200
    assert response.headers["x-request-id"].startswith("req_")
