"""The Batch API's routes (/v1/files, /v1/batches): what they accept, what they refuse and with which
code, and that a client sees only its own files and batches — another client's answer as if they did
not exist, a management key none."""

from __future__ import annotations

import io

import orjson
import pytest
from django.test import Client

from gateway.batch import files as batch_files
from gateway.models import Batch, BatchFile

pytestmark = pytest.mark.django_db(transaction=True)


def line(custom_id, model="m", url="/v1/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}


def jsonl(*items) -> bytes:
    return b"\n".join(item if isinstance(item, bytes) else orjson.dumps(item) for item in items) + b"\n"


def upload(client: Client, key: str, content: bytes, purpose="batch", name="in.jsonl"):
    stream = io.BytesIO(content)
    stream.name = name
    return client.post("/v1/files", {"purpose": purpose, "file": stream}, HTTP_AUTHORIZATION=f"Bearer {key}")


def create(client: Client, key: str, **payload):
    payload.setdefault("endpoint", "/v1/chat/completions")
    payload.setdefault("completion_window", "24h")
    return client.post("/v1/batches", orjson.dumps(payload), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {key}")


def error(answer) -> dict:
    return answer.json()["error"]


@pytest.fixture
def no_runs(monkeypatch):
    """No worker is asked to run what these tests create (the runner has tests of its own)."""
    queued = []
    monkeypatch.setattr("gateway.batch.service.enqueue", queued.append)
    return queued


def test_an_upload_is_checked_line_by_line_and_a_refusal_names_the_line_and_keeps_nothing(make_key, settings,
                                                                                         tmp_path):
    settings.BATCH_DIR = tmp_path
    key = make_key().key
    client = Client()
    cases = [
        (jsonl(line("a"), b"{not json"), 2, "not valid JSON"),
        (jsonl(line("a"), line("a")), 2, "used twice"),
        (jsonl(line("a"), {**line("b"), "method": "GET"}), 2, "`method`"),
        (jsonl(line("a", url="/v1/images")), 1, "`url` must be one of"),
        (jsonl({**line("a"), "body": {"messages": []}}), 1, "`body.model` is required"),
        (jsonl(line("a", stream=True)), 1, "cannot stream"),
        (jsonl({"method": "POST", "url": "/v1/completions", "body": {"model": "m"}}), 1, "`custom_id` is required"),
    ]
    for content, number, reason in cases:
        answer = upload(client, key, content)
        assert answer.status_code == 400, answer.content
        assert error(answer)["code"] == "invalid_batch_file"
        assert error(answer)["details"]["line"] == number and reason in error(answer)["message"], error(answer)
    assert error(upload(client, key, b"\n\n"))["details"]["reason"] == "empty"
    wrong = upload(client, key, jsonl(line("a")), purpose="fine-tune")
    assert wrong.status_code == 400 and error(wrong)["param"] == "purpose"
    settings.BATCH_MAX_FILE_BYTES = 2048
    big = upload(client, key, jsonl(*[line(f"r{i}") for i in range(40)]))
    assert big.status_code == 413 and error(big)["code"] == "request_too_large"
    assert not BatchFile.objects.exists() and not [p for p in tmp_path.iterdir()]  # nothing kept, no temp file


def test_files_are_listed_read_and_deleted_by_their_client_only(make_key, settings, tmp_path, no_runs):
    settings.BATCH_DIR = tmp_path
    owner, neighbour = make_key(), make_key()
    client = Client()
    content = jsonl(line("a"), b"", line("b", model="other"))
    made = upload(client, owner.key, content, name="prompts.jsonl")
    assert made.status_code == 200, made.content
    file = made.json()
    assert file["object"] == "file" and file["purpose"] == "batch" and file["bytes"] == len(content)
    assert file["filename"] == "prompts.jsonl" and file["id"].startswith("file-")
    stored = BatchFile.objects.get(public_id=file["id"])
    assert stored.lines == 2 and stored.model_names == ["m", "other"]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {owner.key}"}
    assert client.get(f"/v1/files/{file['id']}", **auth).json()["id"] == file["id"]
    assert b"".join(client.get(f"/v1/files/{file['id']}/content", **auth).streaming_content) == content
    assert [f["id"] for f in client.get("/v1/files", **auth).json()["data"]] == [file["id"]]
    # The client next door: nothing, and nothing that says it exists.
    other = {"HTTP_AUTHORIZATION": f"Bearer {neighbour.key}"}
    for answer in (client.get(f"/v1/files/{file['id']}", **other),
                   client.get(f"/v1/files/{file['id']}/content", **other),
                   client.delete(f"/v1/files/{file['id']}", **other)):
        assert answer.status_code == 404 and error(answer)["code"] == "file_not_found"
    assert client.get("/v1/files", **other).json()["data"] == []
    assert error(create(client, neighbour.key, input_file_id=file["id"]))["code"] == "file_not_found"
    # An input a batch still reads cannot go; once it has ended, it can.
    batch = create(client, owner.key, input_file_id=file["id"]).json()
    refused = client.delete(f"/v1/files/{file['id']}", **auth)
    assert refused.status_code == 409 and error(refused)["code"] == "file_in_use"
    Batch.objects.filter(public_id=batch["id"]).update(status=Batch.Status.COMPLETED)
    gone = client.delete(f"/v1/files/{file['id']}", **auth)
    assert gone.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert not BatchFile.objects.filter(public_id=file["id"]).exists()
    assert not batch_files.path_of(stored).exists()


def test_a_batch_is_created_listed_and_cancelled_by_its_client_and_refused_clearly(make_key, settings, tmp_path,
                                                                                   no_runs):
    settings.BATCH_DIR = tmp_path
    owner = make_key()
    narrow = make_key(all_models=False, allowed_models=["m"])
    client = Client()
    file_id = upload(client, owner.key, jsonl(line("a"), line("b"))).json()["id"]
    assert error(create(client, owner.key, input_file_id=file_id, endpoint="/v1/embeddings"))["param"] == "endpoint"
    assert error(create(client, owner.key, input_file_id=file_id, completion_window="2d"))["param"] == \
        "completion_window"
    assert error(create(client, owner.key, input_file_id=file_id, metadata={"k": 1}))["param"] == "metadata"
    assert error(create(client, owner.key))["param"] == "input_file_id"
    mixed = upload(client, narrow.key, jsonl(line("a"), line("b", model="not-mine"))).json()["id"]
    refused = create(client, narrow.key, input_file_id=mixed)
    assert refused.status_code == 403 and error(refused)["code"] == "model_not_allowed"
    assert error(refused)["details"]["models"] == ["not-mine"]

    made = create(client, owner.key, input_file_id=file_id, metadata={"job": "nightly"})
    assert made.status_code == 200, made.content
    batch = made.json()
    assert batch["status"] == "validating" and batch["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert batch["input_file_id"] == file_id and batch["metadata"] == {"job": "nightly"}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert no_runs == [batch["id"]]  # a worker is asked to run it
    auth = {"HTTP_AUTHORIZATION": f"Bearer {owner.key}"}
    assert [b["id"] for b in client.get("/v1/batches", **auth).json()["data"]] == [batch["id"]]
    other = {"HTTP_AUTHORIZATION": f"Bearer {narrow.key}"}
    for answer in (client.get(f"/v1/batches/{batch['id']}", **other),
                   client.post(f"/v1/batches/{batch['id']}/cancel", **other)):
        assert answer.status_code == 404 and error(answer)["code"] == "batch_not_found"
    assert client.get("/v1/batches", **other).json()["data"] == []
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", **auth).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"]
    Batch.objects.filter(public_id=batch["id"]).update(status=Batch.Status.CANCELLED)
    again = client.post(f"/v1/batches/{batch['id']}/cancel", **auth)
    assert again.status_code == 409 and error(again)["code"] == "batch_ended"


def test_pages_follow_the_cursor_and_refuse_a_bad_one(make_key, settings, tmp_path, no_runs):
    settings.BATCH_DIR = tmp_path
    owner = make_key()
    client = Client()
    ids = [upload(client, owner.key, jsonl(line(f"r{i}"))).json()["id"] for i in range(3)]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {owner.key}"}
    first = client.get("/v1/files?limit=2", **auth).json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = client.get(f"/v1/files?limit=2&after={first['last_id']}", **auth).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert error(client.get("/v1/files?after=file-nope", **auth))["param"] == "after"
    assert error(client.get("/v1/files?limit=0", **auth))["param"] == "limit"


def test_only_a_key_that_may_use_the_inference_api_reaches_it(make_key):
    client = Client()
    assert error(client.get("/v1/files"))["code"] == "missing_api_key"
    assert error(client.get("/v1/files", HTTP_AUTHORIZATION="Bearer brk_nope"))["code"] == "invalid_api_key"
    management = make_key(access="management")
    answer = client.get("/v1/batches", HTTP_AUTHORIZATION=f"Bearer {management.key}")
    assert answer.status_code == 403 and error(answer)["code"] == "inference_not_allowed"
    anthropic_style = client.get("/v1/batches", HTTP_X_API_KEY=make_key().key)
    assert anthropic_style.status_code == 200 and anthropic_style.json()["data"] == []
    assert client.put("/v1/batches", HTTP_AUTHORIZATION=f"Bearer {make_key().key}").status_code == 405
