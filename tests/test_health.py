"""/healthz says the process answers; /readyz that the database, the broker and the control loop do too."""

import time
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from berth import health, lease
from berth.celery import app as celery_app
from scheduler.models import Node
from serving.control import reconcile

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_login(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_the_real_database_and_redis(client, settings):
    assert settings.CELERY_BROKER_URL.startswith("redis://")
    _ready_loop(1)
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {"database": "ok", "broker": "ok", "control_loop": "ok", "agents": "none_seen"}


def test_readyz_is_503_when_the_broker_is_unreachable(client):
    reachable = celery_app.conf.broker_url
    celery_app.conf.broker_url = "redis://127.0.0.1:9/0"  # the discard port: nothing listens there
    _ready_loop(1)
    try:
        response = client.get("/readyz")
    finally:
        celery_app.conf.broker_url = reachable
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not_ready"
    assert body["checks"]["broker"] == "unavailable" and body["checks"]["database"] == "ok"
    assert body["failing"] == ["broker"]


# The control loop: its pass writes berth:control:last-pass; time is driven by writing old values.

def _ready_loop(age_s: float) -> None:
    cache.set(health.LAST_PASS_KEY, time.time() - age_s, None)


def test_readyz_names_the_checks_and_passes_with_a_fresh_control_loop(client):
    _ready_loop(1)
    response = client.get("/readyz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready"
    assert body["checks"]["control_loop"] == "ok"
    assert body["details"]["control_loop"]["stale_after_s"] == 45.0  # 3 x the 15 s beat interval
    assert "failing" not in body


def test_readyz_is_503_within_three_missed_passes_of_a_stopped_loop(client):
    _ready_loop(44)  # two passes and a bit missed: still ready
    assert client.get("/readyz").status_code == 200
    _ready_loop(46)  # the third missed
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["control_loop"] == "stale"
    assert body["failing"] == ["control_loop"]
    # Nothing more sensitive than the loop's timings, the agents counted and the lease's holder.
    assert set(body) == {"status", "checks", "details", "failing"}
    assert set(body["details"]["control_loop"]) == {"pass_interval_s", "stale_after_s", "last_pass_age_s",
                                                    "pass_running", "holder", "lease_age_s",
                                                    "lease_renewed_age_s", "lease_expired"}
    assert "secret" not in response.content.decode().lower()


def test_a_loop_that_never_ran_is_starting_for_three_intervals_then_fails(client, monkeypatch):
    cache.delete(health.LAST_PASS_KEY)
    monkeypatch.setattr(health, "STARTED_AT", time.time() - 10)  # a young process
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"]["control_loop"] == "starting"
    monkeypatch.setattr(health, "STARTED_AT", time.time() - 46)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["control_loop"] == "never_ran"


def test_a_real_pass_marks_the_loop_alive(client):
    _ready_loop(3600)
    reconcile.run()
    assert time.time() - cache.get(health.LAST_PASS_KEY) < 10
    assert client.get("/readyz").json()["checks"]["control_loop"] == "ok"


def test_a_running_pass_and_the_leases_holder_are_shown(client):
    _ready_loop(1)
    lease.claim(lease.CONTROL_LOOP, "web-1:4242", 45)  # tests/serving/test_control_lease.py: the lease itself
    cache.set(health.PASS_LOCK_KEY, "web-1:4242:0123abcd", 30)
    try:
        detail = client.get("/readyz").json()["details"]["control_loop"]
    finally:
        cache.delete(health.PASS_LOCK_KEY)
    assert detail["pass_running"] is True
    assert detail["holder"] == "web-1:4242" and detail["lease_expired"] is False
    assert 0 <= detail["lease_renewed_age_s"] <= detail["lease_age_s"] < 60


def test_agents_seen_are_reported_and_do_not_fail_readiness(client):
    _ready_loop(1)
    Node.objects.create(name="fresh", address="127.0.0.1", last_heartbeat_at=timezone.now())
    Node.objects.create(name="gone", address="127.0.0.1", state=Node.State.LOST,
                        last_heartbeat_at=timezone.now() - timedelta(hours=1))
    body = client.get("/readyz").json()
    assert body["checks"]["agents"] == "ok"
    assert body["details"]["agents"] == {"fresh": 1, "lost": 1}
    Node.objects.filter(name="fresh").update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"]["agents"] == "none_seen"
