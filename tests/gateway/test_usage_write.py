"""Usage records as the gateway writes them (``gateway.usage.write_batch``): every column as given,
priced, and a batch written whole or not at all (COPY on PostgreSQL, ``bulk_create`` on SQLite)."""

import uuid
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from gateway.models import ModelPrice, UsageRecord
from gateway.usage import write_batch

pytestmark = pytest.mark.django_db

AT = 1_790_000_000.25


def row(**fields) -> dict:
    return {"request_id": uuid.uuid4().hex, "started_at": AT - 1.5, "finished_at": AT, "endpoint": "chat/completions",
            "stream": True, "model_asked": "alias", "model_served": "priced", "replica_id": str(uuid.uuid4()),
            "status": 200, "error_code": None, "queue_ms": 12.5, "ttft_ms": 40.25, "total_ms": 1500.0,
            "prompt_tokens": 1200, "completion_tokens": 300, "credential_id": 7, "key_prefix": "bk_abc",
            "client_id": 8, "project_id": 9, "scope_path": "acme/ml/search", **fields}


def test_every_column_is_written_as_given_and_priced():
    ModelPrice.objects.create(model_name="priced", prompt_per_1k=Decimal("0.5"), completion_per_1k=Decimal("2"))
    given = row()
    unpriced = row(model_served="free", error_code="upstream_error", status=502, prompt_tokens=None,
                   completion_tokens=None, replica_id=None, queue_ms=None, ttft_ms=None, stream=False,
                   key_prefix=None, scope_path="", credential_id=None, client_id=None, project_id=None)
    assert write_batch([given, unpriced]) == 2
    record = UsageRecord.objects.get(request_id=given["request_id"])
    assert record.started_at == datetime.fromtimestamp(AT - 1.5, timezone.utc)
    assert record.finished_at == datetime.fromtimestamp(AT, timezone.utc)
    assert (record.endpoint, record.stream, record.model_asked, record.model_served, str(record.replica_id),
            record.status, record.error_code, record.queue_ms, record.ttft_ms, record.total_ms) == (
        "chat/completions", True, "alias", "priced", given["replica_id"], 200, "", 12.5, 40.25, 1500.0)
    assert (record.prompt_tokens, record.completion_tokens, record.credential_id, record.key_prefix,
            record.client_id, record.project_id, record.scope_path) == (1200, 300, 7, "bk_abc", 8, 9, "acme/ml/search")
    assert record.cost == Decimal("1.2")  # 1.2k prompt at 0.5 + 0.3k completion at 2
    other = UsageRecord.objects.get(request_id=unpriced["request_id"])
    assert (other.status, other.error_code, other.cost, other.replica_id, other.prompt_tokens, other.key_prefix,
            other.client_id) == (502, "upstream_error", None, None, None, "", None)


def test_a_batch_the_database_refuses_is_written_not_at_all():
    with pytest.raises(Exception):
        write_batch([row(), row(status=None)])  # status is required: the second row is refused
    assert not UsageRecord.objects.exists()
