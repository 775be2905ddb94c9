"""/healthz says the process answers; /readyz that the database and the broker do too."""

import pytest

from berth.celery import app as celery_app

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_login(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_the_real_database_and_redis(client, settings):
    assert settings.CELERY_BROKER_URL.startswith("redis://")
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok"}}


def test_readyz_is_503_when_the_broker_is_unreachable(client):
    reachable = celery_app.conf.broker_url
    celery_app.conf.broker_url = "redis://127.0.0.1:9/0"  # the discard port: nothing listens there
    try:
        response = client.get("/readyz")
    finally:
        celery_app.conf.broker_url = reachable
    assert response.status_code == 503
    assert response.json() == {"status": "not_ready", "checks": {"database": "ok", "broker": "unavailable"}}
