"""Batches run through the real gateway and llama-server: each line sent once and answered in the output
or error file; a line a gateway already sent is refused again; a key revoked, a batch cancelled or its
window ended stop what is left; a real Celery worker killed midway is taken over without a line sent
twice; and a batch's burst delays an interactive request by one in-flight request at most."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta

import httpx
import orjson
import pytest
from django.db import connection
from django.utils import timezone

from gateway.batch import files, lines, runner, service
from gateway.models import Batch, BatchFile, BatchLine, UsageRecord
from tests.assets.database import database_environ
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chat_line(custom_id: str, model: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Say {custom_id}."}],
                     "max_tokens": 2, **body}}


def make_batch(key, items, endpoint="/v1/chat/completions") -> Batch:
    """A batch of ``items`` for ``key`` as /v1/files and /v1/batches would make it (no worker asked)."""
    from gateway.auth import load_principal

    principal, _ = load_principal(key.key)
    content = b"".join(orjson.dumps(item) + b"\n" for item in items)
    file = files.store_upload([content], "in.jsonl", principal.client_pk)
    return service.create(principal, {"input_file_id": file.public_id, "endpoint": endpoint})


def read_file(file: BatchFile | None) -> list[dict]:
    if file is None:
        return []
    return [orjson.loads(raw) for raw in b"".join(files.content(file)).splitlines()]


@pytest.fixture
def through(gateway, settings, monkeypatch):
    """Runs in this process go to the gateway under test; nothing is queued to a worker."""
    settings.SERVING_GATEWAY_URL = gateway.base_url
    monkeypatch.setattr("gateway.batch.service.enqueue", lambda public_id: None)
    return gateway


def test_every_line_is_answered_once_in_the_output_or_error_file(through, chat_engine, deploy, make_key):
    deploy("batch-chat", chat_engine)
    key = make_key()
    items = [chat_line(f"q{i}", "batch-chat") for i in range(12)] + [chat_line("lost", "no-such-model")]
    batch = make_batch(key, items)
    assert runner.run(batch.public_id) == Batch.Status.COMPLETED
    batch.refresh_from_db()
    assert (batch.total, batch.completed, batch.failed) == (13, 12, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    output, errors = read_file(batch.output_file), read_file(batch.error_file)
    assert sorted(o["custom_id"] for o in output) == sorted(f"q{i}" for i in range(12))
    for item in output:
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert item["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
        assert item["response"]["request_id"] and item["id"].startswith("batch_req_")
    assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["code"])
            for e in errors] == [("lost", 404, "model_not_found")]
    # Charged like any request of the key: one usage record each, none sent twice.
    wait_until(lambda: UsageRecord.objects.filter(credential_id=key.credential.pk).count() == 13, 10,
               what="the batch's usage records written")
    assert UsageRecord.objects.filter(credential_id=key.credential.pk, status=200).count() == 12
    # The answers now live only in the files.
    assert not BatchLine.objects.filter(batch=batch).exclude(response="").exists()
    assert runner.run(batch.public_id) == Batch.Status.COMPLETED  # run again: nothing happens


def test_a_line_is_sent_once_and_only_with_a_signature_that_holds(through, chat_engine, deploy, make_key):
    deploy("batch-chat", chat_engine)
    batch = make_batch(make_key(), [chat_line("only", "batch-chat"), chat_line("flow", "batch-chat", stream=False)])
    BatchLine.objects.bulk_create([BatchLine(batch=batch, index=i, custom_id=c) for i, c in ((0, "only"), (1, "flow"))])
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.IN_PROGRESS)
    body = {"model": "batch-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{through.base_url}/v1/chat/completions"

    def send(header, **extra):
        return httpx.post(url, json={**body, **extra}, headers={"x-berth-batch": header}, timeout=60)

    first = send(lines.sign(batch.public_id, 0))
    assert first.status_code == 200, first.text
    again = send(lines.sign(batch.public_id, 0))
    assert again.status_code == 409 and again.json()["error"]["code"] == "batch_line_taken"
    line = BatchLine.objects.get(batch=batch, index=0)
    assert line.state == "done" and line.status_code == 200 and line.request_id == first.headers["x-request-id"]
    assert orjson.loads(line.response)["choices"]  # kept by the gateway before it answered
    forged = send(lines.sign(batch.public_id, 1)[:-4] + "0000")
    assert forged.status_code == 401 and forged.json()["error"]["code"] == "invalid_batch_signature"
    streamed = send(lines.sign(batch.public_id, 1), stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert BatchLine.objects.get(batch=batch, index=1).state == "pending"  # refused before it was sent


def test_a_revoked_key_ends_every_line_left(through, chat_engine, deploy, make_key, tree):
    from tenancy.services import clients

    deploy("batch-chat", chat_engine)
    key = make_key()
    batch = make_batch(key, [chat_line(f"q{i}", "batch-chat") for i in range(5)])
    clients.revoke_credential(tree.actor, key.credential)
    assert runner.run(batch.public_id) == Batch.Status.COMPLETED
    batch.refresh_from_db()
    errors = read_file(batch.error_file)
    assert batch.failed == 5 and batch.output_file is None
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"api_key_revoked"}


def test_cancelled_or_expired_lines_are_written_to_the_error_file_unsent(through, make_key):
    key = make_key()
    cancelled = make_batch(key, [chat_line(f"q{i}", "m") for i in range(3)])
    service.cancel(cancelled)
    assert runner.run(cancelled.public_id) == Batch.Status.CANCELLED
    cancelled.refresh_from_db()
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in read_file(cancelled.error_file)] == \
        [(f"q{i}", None, "batch_cancelled") for i in range(3)]
    assert cancelled.cancelled_at and cancelled.total == 3 and cancelled.failed == 3

    expired = make_batch(key, [chat_line("late", "m")])
    Batch.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert runner.run(expired.public_id) == Batch.Status.EXPIRED
    expired.refresh_from_db()
    assert [e["error"]["code"] for e in read_file(expired.error_file)] == ["batch_expired"]
    assert not UsageRecord.objects.filter(credential_id=key.credential.pk).exists()  # nothing was sent


class Worker:
    """A real Celery worker on the batch queue, as `manage.py serve` runs it, stopped by its PID."""

    def __init__(self, log_path, gateway_url: str):
        env = dict(os.environ, **database_environ(connection.settings_dict), BERTH_GATEWAY_INTERNAL_URL=gateway_url,
                   BERTH_BATCH_LEASE_SECONDS="3", BERTH_LOG_LEVEL="INFO")
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "berth.celery", "worker", "-Q", "batch", "-n",
             f"batch-{uuid.uuid4().hex[:6]}@%h", "--pool", "threads", "--concurrency", "2", "--without-mingle",
             "--without-gossip", "--loglevel", "INFO"], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=20)
        self._log.close()


def test_a_worker_killed_midway_is_taken_over_and_no_line_is_sent_twice(gateway, chat_engine, deploy, make_key,
                                                                        artifacts_dir, tmp_path):
    """~200 chat lines through the openai client's Files and Batches API; the worker running them is
    SIGKILLed midway; the sweep (what beat runs every few seconds) queues the batch again once its
    lease lapses, a new worker finishes it, and every line was sent exactly once."""
    from gateway.tasks import sweep_batches

    deploy("batch-chat", chat_engine)
    key = make_key()
    client = gateway.openai(key.key)
    source = tmp_path / "lines.jsonl"
    source.write_bytes(b"".join(orjson.dumps(chat_line(f"q{i}", "batch-chat")) + b"\n" for i in range(200)))
    with open(source, "rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    first = Worker(artifacts_dir / "batch-worker-1.log", gateway.base_url)
    try:
        created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        done = BatchLine.objects.filter(batch__public_id=created.id, state="done")
        wait_until(lambda: done.count() >= 50, 120, what="a quarter of the batch answered")
    finally:
        first.kill()
    at_kill = done.count()
    assert at_kill < 200, "the batch ended before its worker was killed"
    second = Worker(artifacts_dir / "batch-worker-2.log", gateway.base_url)
    try:
        wait_until(lambda: sweep_batches()["queued"] == [created.id], 30, what="the batch queued again")
        wait_until(lambda: client.batches.retrieve(created.id).status == "completed", 240, what="the batch completed")
    finally:
        second.kill()
    final = client.batches.retrieve(created.id)
    assert final.request_counts.total == 200 and final.request_counts.completed == 200
    assert final.request_counts.failed == 0 and final.error_file_id is None
    output = [orjson.loads(raw) for raw in client.files.content(final.output_file_id).content.splitlines()]
    assert sorted(item["custom_id"] for item in output) == sorted(f"q{i}" for i in range(200))
    wait_until(lambda: UsageRecord.objects.filter(credential_id=key.credential.pk,
                                                  endpoint="chat/completions").count() >= 200, 10,
               what="the batch's usage records written")
    sent = UsageRecord.objects.filter(credential_id=key.credential.pk, endpoint="chat/completions")
    assert sent.count() == 200 and sent.filter(status=200).count() == 200  # each line once; none refused as taken


def test_a_batch_burst_delays_an_interactive_request_by_one_in_flight_request_at_most(
        through, llama_server_binary, smollm2_model, artifacts_dir, deploy, make_key, settings):
    from serving.keys import replica_key
    from tests.assets.llama_server import LlamaServer
    from tests.gateway.test_slots import _waiting, types_namespace

    replica_id = str(uuid.uuid4())
    server = LlamaServer(llama_server_binary, smollm2_model, artifacts_dir / "gw-batch-one-slot.log",
                         api_key=replica_key(replica_id), threads=1, parallel=1)
    try:
        server.wait_ready()
        deploy("one-slot-batch", types_namespace(server, replica_id), task="completion")
        settings.BATCH_CONCURRENCY = 6
        item = {"method": "POST", "url": "/v1/completions",
                "body": {"model": "one-slot-batch", "prompt": "a", "max_tokens": 24, "ignore_eos": True}}
        critical = make_key(priority="critical")
        warm = httpx.get(f"{through.base_url}/v1/models", headers={"Authorization": f"Bearer {critical.key}"},
                         timeout=30)  # its key known to the gateway: what is measured is the wait for the slot
        assert warm.status_code == 200, warm.text
        batch = make_batch(make_key(), [{**item, "custom_id": f"b{i}"} for i in range(16)], "/v1/completions")
        running = threading.Thread(target=lambda: (runner.run(batch.public_id), connection.close()))
        running.start()
        try:
            wait_until(lambda: _waiting(through, "one-slot-batch") >= 4, 60, what="batch lines waiting for the slot")
            answer = httpx.post(f"{through.base_url}/v1/completions", timeout=120,
                                headers={"Authorization": f"Bearer {critical.key}", "X-Request-Id": "critical-one"},
                                json={"model": "one-slot-batch", "prompt": "a", "max_tokens": 4, "ignore_eos": True})
            answered_at = timezone.now()
            assert answer.status_code == 200, answer.text
        finally:
            running.join(timeout=300)
        assert not running.is_alive()
        batch.refresh_from_db()
        assert batch.status == "completed" and batch.completed == 16
        # While it waited, at most the batch line already given the slot could run ahead of it: counted
        # from when the gateway had the request (its usage record), not from when this test sent it.
        wait_until(lambda: UsageRecord.objects.filter(request_id="critical-one").exists(), 30,
                   what="the critical request's usage record")
        arrived = UsageRecord.objects.get(request_id="critical-one").started_at
        ahead = BatchLine.objects.filter(batch=batch, claimed_at__gt=arrived, claimed_at__lt=answered_at).count()
        assert ahead <= 1, ahead
        waited = BatchLine.objects.filter(batch=batch, claimed_at__gt=answered_at).count()
        assert waited >= 3  # lines were still waiting when it was served: it went ahead of them
    finally:
        server.stop()
