"""Disconnects, dying replicas, retries, admission while a model loads, and what is never stored."""

import threading
import time
import uuid

import httpx
import openai
import pytest
from django.apps import apps
from django.core import serializers

from gateway.models import UsageRecord
from serving import events, load
from serving.control import routing
from serving.keys import replica_key
from serving.models import Deployment, Replica
from tests.assets.llama_server import LlamaServer, free_port
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess
from tests.gateway.usage import record_of

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]


def waiting(gateway, model: str) -> float:
    """Requests the gateway holds in its admission queue for ``model`` now (its Prometheus gauge)."""
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    line = next((l for l in text.splitlines() if l.startswith(f'berth_gateway_waiting{{model="{model}"}}')), "")
    return float(line.split()[-1]) if line else 0.0


def cancellations(server) -> int:
    return server.log_tail(10**7).count("cancel task")


def test_client_disconnect_cancels_the_engines_request(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    key = make_key().key
    before = cancellations(chat_engine.server)
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", "X-Request-Id": "leaves-early"},
                      json={"model": "smollm2", "stream": True, "max_tokens": 900, "temperature": 1,
                            "messages": [{"role": "user", "content": "Write a very long story."}]}) as response:
        assert response.status_code == 200
        next(response.iter_raw())
    # The engine logs "cancel task" when its caller goes away (900 tokens would take it many seconds).
    wait_until(lambda: cancellations(chat_engine.server) > before, 5, interval=0.05,
               what="the engine cancelling the request")
    assert record_of("leaves-early").status == 499


def test_a_replica_killed_mid_stream_gives_a_clean_error(gateway, llama_server_binary, smollm2_model, tmp_path,
                                                         deploy, make_key):
    replica_id = str(uuid.uuid4())
    server = LlamaServer(llama_server_binary, smollm2_model, tmp_path / "doomed.log", api_key=replica_key(replica_id),
                         threads=1, context=1024)
    try:
        server.wait_ready()
        deploy("doomed", replica_id=replica_id, port=server.port)
        stream = gateway.openai(make_key().key).chat.completions.create(
            model="doomed", stream=True, max_tokens=600, messages=[{"role": "user", "content": "Tell a long tale."}],
            extra_headers={"X-Request-Id": "killed-mid-stream"})
        with pytest.raises(openai.APIError) as raised:
            for count, _ in enumerate(stream):
                if count == 2:
                    server.process.kill()
        assert "mid-stream" in str(raised.value)
    finally:
        server.stop()
    assert record_of("killed-mid-stream").status == 502


def test_a_connection_failure_is_retried_on_another_replica(gateway, tiny_engine, deploy, make_key, node):
    made = deploy("tiny", tiny_engine, task="completion")
    Replica.objects.create(deployment=made.deployment, node=node, port=free_port(), state="ready")  # nobody listens
    events.routing_changed()
    key = make_key().key
    statuses = [httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           timeout=60, json={"model": "tiny", "prompt": "a", "max_tokens": 1}).status_code
                for _ in range(6)]
    assert statuses == [200] * 6


def test_a_request_waits_for_a_loading_model_and_is_served_when_it_is_ready(gateway, llama_server_binary,
                                                                            tiny_model, tmp_path, deploy, make_key):
    replica_id = str(uuid.uuid4())
    server = LlamaServer(llama_server_binary, tiny_model, tmp_path / "cold.log", api_key=replica_key(replica_id),
                         threads=1)
    try:
        made = deploy("cold", state="loading", replica_state="loading", replica_id=replica_id, port=server.port)
        client = gateway.openai(make_key().key)
        outcome = {}

        def ask():
            try:
                outcome["answer"] = client.completions.create(model="cold", prompt="hello", max_tokens=3,
                                                              extra_headers={"X-Request-Id": "cold-start"})
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                outcome["error"] = exc

        waiter = threading.Thread(target=ask)
        waiter.start()
        server.wait_ready()
        wait_until(lambda: waiting(gateway, "cold") == 1, 30, what="the request waiting in the admission queue")
        Replica.objects.filter(pk=made.replica.pk).update(state="ready")
        Deployment.objects.filter(pk=made.deployment.pk).update(state="ready")
        events.routing_changed()
        waiter.join(60)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["answer"].usage.completion_tokens == 3
    finally:
        server.stop()
    assert record_of("cold-start").queue_ms > 0  # it was seen waiting above, and the record says so


def test_admission_times_out_with_retry_after_and_a_full_queue_is_429(gateway_b, deploy, make_key):
    deploy("slow-loader", state="loading", replica_state="loading", replica_id=str(uuid.uuid4()), port=free_port())
    key = make_key().key

    def ask():
        return httpx.post(f"{gateway_b.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=30, json={"model": "slow-loader", "prompt": "a"})

    results = []
    first = threading.Thread(target=lambda: results.append(ask()))
    first.start()
    wait_until(lambda: waiting(gateway_b, "slow-loader") == 1, 30, what="the first request queued")
    second = ask()  # the queue holds one (this process's setting): the second is turned away at once
    first.join()
    assert second.status_code == 429 and second.json()["error"]["code"] == "queue_full"
    timed_out = results[0]
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "model_loading"
    assert int(timed_out.headers["retry-after"]) >= 1


@pytest.fixture
def gateway_c(django_db_setup, django_db_blocker, artifacts_dir):
    """A process whose waiting requests outlast a load report or two (reported every two seconds)."""
    with django_db_blocker.unblock():
        process = GatewayProcess(artifacts_dir / "gateway-c.log", admission_timeout=8, admission_queue=4)
    yield process
    process.stop()


def test_requests_waiting_at_the_batch_priority_are_reported_as_such_to_the_placement_loop(gateway_c, deploy,
                                                                                            make_key):
    deploy("batch-loader", state="loading", replica_state="loading", replica_id=str(uuid.uuid4()), port=free_port())
    batch_key, interactive_key = make_key(priority="batch").key, make_key(priority="high").key

    def ask(key):
        return httpx.post(f"{gateway_c.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=30, json={"model": "batch-loader", "prompt": "a"})

    results = []
    first = threading.Thread(target=lambda: results.append(ask(batch_key)))
    first.start()
    wait_until(lambda: load.current().waiting_batch.get("batch-loader") == 1, 30,
               what="the batch client's request reported waiting at the batch priority")
    assert load.current().waiting["batch-loader"] == 1  # one waits, and it is a batch one: nothing preempted for it
    first.join()
    assert results[0].json()["error"]["code"] == "model_loading"
    second = threading.Thread(target=lambda: results.append(ask(interactive_key)))
    second.start()
    wait_until(lambda: (lambda now: now.waiting.get("batch-loader") == 1 and not now.waiting_batch)(load.current()),
               30, what="the interactive request reported waiting, above the batch priority")
    second.join()
    assert results[1].json()["error"]["code"] == "model_loading"


def test_a_model_that_will_not_come_up_is_refused_at_once_without_retry_after(gateway, deploy, make_key):
    made = deploy("parked", state="failed")
    Deployment.objects.filter(pk=made.deployment.pk).update(state_detail="out of memory three times")
    events.routing_changed()
    started = time.monotonic()
    answer = httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {make_key().key}"},
                        timeout=30, json={"model": "parked", "prompt": "a"})
    assert time.monotonic() - started < 5
    assert answer.status_code == 503 and "retry-after" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "model_not_loaded" and "no deployment can serve it" in error["message"]


def test_no_request_or_response_content_lands_in_any_table_or_log(gateway, chat_engine, deploy, make_key):
    deploy("smollm2", chat_engine)
    marker = "zebra-" + uuid.uuid4().hex[:8]
    client = gateway.openai(make_key().key)
    answer = client.chat.completions.create(
        model="smollm2", max_tokens=8, extra_headers={"X-Request-Id": "content-check"},
        messages=[{"role": "user", "content": f"Repeat exactly: {marker}"}])
    list(client.chat.completions.create(model="smollm2", max_tokens=8, stream=True,
                                        extra_headers={"X-Request-Id": "content-check-2"},
                                        messages=[{"role": "user", "content": f"Say {marker}"}]))
    record_of("content-check-2")
    said = answer.choices[0].message.content.strip()
    for model in apps.get_models():
        dump = serializers.serialize("json", model.objects.all())
        assert marker not in dump, model
        if len(said) > 12:
            assert said not in dump, model
    assert "content-check" in gateway.log() and marker not in gateway.log()


def test_a_gateway_told_to_stop_writes_the_usage_it_still_buffers(tmp_path, chat_engine, deploy, make_key):
    """The lifespan production runs with (berth/web.py): on SIGTERM the batch not yet due is written."""
    stopping = GatewayProcess(tmp_path / "stopping.log", usage_flush_ms=600_000)  # no timed flush in this test
    try:
        deploy("smollm2", chat_engine)
        response = httpx.post(f"{stopping.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {make_key().key}", "X-Request-Id": "buffered-at-stop"},
                              json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert response.status_code == 200
        assert not UsageRecord.objects.filter(request_id="buffered-at-stop").exists()  # still in the batch
    finally:
        stopping.stop()
    assert "Application shutdown complete" in stopping.log(), stopping.log()[-2000:]
    record = UsageRecord.objects.get(request_id="buffered-at-stop")
    assert record.status == 200 and record.model_served == "smollm2"


def test_sigterm_under_load_writes_the_usage_of_every_answered_request(tmp_path, chat_engine, deploy, make_key):
    """Requests in flight when the web process is told to stop: each one answered 2xx has its record."""
    stopping = GatewayProcess(tmp_path / "under-load.log", usage_flush_ms=600_000)
    deploy("smollm2", chat_engine)
    key = make_key().key
    answered: dict[str, int] = {}

    def ask(n: int) -> None:
        request_id = f"load-{n}"
        try:
            response = httpx.post(f"{stopping.base_url}/v1/chat/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id},
                                  json={"model": "smollm2", "max_tokens": 8,
                                        "messages": [{"role": "user", "content": f"Count to {n}."}]})
            answered[request_id] = response.status_code
        except httpx.HTTPError:
            pass  # refused once the server stopped accepting: never answered, so nothing to record

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(12)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len(answered) >= 3, 60, interval=0.05, what="the first answers under load")
    finally:
        stopping.stop()  # SIGTERM while the rest are in flight or queued at the engine
        for thread in threads:
            thread.join(timeout=60)
    ok = sorted(request_id for request_id, status in answered.items() if 200 <= status < 300)
    assert len(ok) >= 3
    written = set(UsageRecord.objects.filter(request_id__in=ok).values_list("request_id", flat=True))
    assert written == set(ok), f"usage lost for {sorted(set(ok) - written)}"
