"""Measured speed per catalog profile: what counts as a measurement, how the sums fade, and how the
placement loop uses it — among profiles of equal priority, the most tokens/s per core first.
(tests/gateway/test_inference.py checks that requests through the real gateway feed it.)"""

from __future__ import annotations

import dataclasses
import shutil
import uuid

import pytest
from django.core.cache import cache

from scheduler.services import register_node
from serving import queues
from serving.catalog import room, speed
from serving.catalog.entries import import_local
from serving.models import ModelEntry, ProfileSpeed
from serving.control import placement
from serving.deployments import service
from serving.node.discovery import local_node_report
from serving.models import Deployment, Replica
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db
ACTOR = Actor(system="tests")


@pytest.fixture
def catalog(tmp_path, settings, tiny_model, monkeypatch):
    """A node, and the tiny model in the catalog with two CPU profiles of equal priority."""
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    cache.clear()
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)
    node = register_node(dataclasses.replace(local_node_report(), name="speed-node"))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "s.gguf"), name="quick")
    first = {**entry.profiles[0], "context": 256, "priority": 50}
    ModelEntry.objects.filter(pk=entry.pk).update(profiles=[
        {**first, "name": "two-cores", "cores": 2}, {**first, "name": "one-core", "cores": 1}])
    entry.refresh_from_db()
    return node, entry


def replica_of(node, model="quick", profile="two-cores") -> str:
    deployment = Deployment.objects.create(name=model, model_path="/m/x.gguf", node=node, profile=profile,
                                           state="ready")
    return str(Replica.objects.create(deployment=deployment, node=node, port=20000 + Replica.objects.count(),
                                      state="ready").public_id)


def row(replica, **fields):
    return {"replica_id": replica, "status": 200, "stream": False, "completion_tokens": 40, "total_ms": 2000.0,
            "queue_ms": 0.0, "ttft_ms": None, **fields}


def test_what_counts_and_how(catalog):
    node, _ = catalog
    fast = replica_of(node)
    by_hand = replica_of(node, model="by-hand", profile="")
    counted = speed.note([
        row(fast),  # 40 tokens in 2 s
        row(fast, stream=True, completion_tokens=21, ttft_ms=500.0, total_ms=1500.0),  # 20 tokens after the first, 1 s
        row(fast, total_ms=3000.0, queue_ms=1000.0),  # the queue is not generation: 40 in 2 s
        row(fast, status=500), row(fast, completion_tokens=3),  # failed; too few tokens to say anything
        row(by_hand), row(str(uuid.uuid4())),  # a deployment made by hand; a replica nobody knows
        row(None),
    ])
    assert counted == 3
    measured = ProfileSpeed.objects.get()
    assert (measured.model, measured.profile, measured.requests) == ("quick", "two-cores", 3)
    assert (measured.tokens, measured.seconds) == (100.0, 5.0)
    assert speed.measured() == {("quick", "two-cores"): 20.0}
    assert speed.note([]) == 0 and speed.note([row(fast, status=429)]) == 0


def test_the_sums_fade_so_the_figure_follows_the_recent_past(catalog):
    node, _ = catalog
    replica = replica_of(node)
    speed.note([row(replica, completion_tokens=10 * 3000, total_ms=3000 * 1000.0)])  # 10 tokens/s for 50 minutes
    speed.note([row(replica, completion_tokens=30 * 1200, total_ms=1200 * 1000.0)])  # then 30 tokens/s for 20
    measured = ProfileSpeed.objects.get()
    assert measured.seconds == pytest.approx(speed.WINDOW_S / 2)  # past the hour: scaled back to half of it
    assert measured.tokens_per_second == pytest.approx((30_000 + 36_000) / 4200)  # the ratio is kept
    speed.note([row(replica, completion_tokens=30 * 1800, total_ms=1800 * 1000.0)])  # 30 minutes more at 30
    assert ProfileSpeed.objects.get().tokens_per_second > measured.tokens_per_second + 3  # the old 10 weighs less


def test_placement_tries_the_fastest_per_core_first_among_equal_priorities(catalog):
    node, entry = catalog
    assert [p.tokens_per_s for p in room.desired_model(entry).profiles] == [None, None]  # nothing measured yet
    ProfileSpeed.objects.create(model="quick", profile="two-cores", tokens=300.0, seconds=10.0, requests=5)  # 15/core
    ProfileSpeed.objects.create(model="quick", profile="one-core", tokens=200.0, seconds=10.0, requests=5)  # 20/core
    [model] = [m for m in placement.snapshot().models if m.id == "quick"]
    assert {p.name: p.tokens_per_s for p in model.profiles} == {"two-cores": 30.0, "one-core": 20.0}
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1)
    assert placement.reconcile()["launched"] == ["quick"]
    assert Deployment.objects.get(name="quick").profile == "one-core"


def test_the_card_and_the_api_show_the_measured_speed(catalog, admin_client):
    node, entry = catalog
    ProfileSpeed.objects.create(model="quick", profile="one-core", tokens=123.0, seconds=10.0, requests=4)
    page = admin_client.get(f"/models/held/{entry.public_id}/").content.decode()
    assert "12.3 tokens/s over 4 requests" in page and "not measured yet" in page  # two-cores: nothing yet
    listed = admin_client.get("/api/serving/catalog/models/").json()
    [mine] = [m for m in listed["results"] if m["name"] == "quick"] if "results" in listed else \
        [m for m in listed if m["name"] == "quick"]
    assert mine["measured_tokens_per_second"] == {"one-core": 12.3}
    one = admin_client.get(f"/api/serving/catalog/models/{entry.public_id}/").json()
    assert one["measured_tokens_per_second"] == {"one-core": 12.3}
