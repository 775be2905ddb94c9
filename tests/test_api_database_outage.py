"""The API while PostgreSQL refuses it: a real web process reaches the test database through a TCP
proxy the test cuts and restores. While the database is away, the API says so plainly and when to ask
again — 503 ``database_unavailable`` with Retry-After, as the gateway does, within seconds — and once
it is back the very next request is served."""

from __future__ import annotations

import time

import httpx
import pytest
from django.db import connection

from scheduler import enrolment
from tenancy.audit import Actor
from tests.assets.database import through
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(connection.vendor != "postgresql",
                                 reason="a database outage needs a database server to cut off: SQLite is a file")]


@pytest.fixture
def web(database_proxy, artifacts_dir):
    process = GatewayProcess(artifacts_dir / "api-database-outage.log", environ=through(database_proxy))
    yield process
    process.stop()


def test_the_api_answers_503_while_the_database_is_away_and_serves_once_it_is_back(web, database_proxy):
    credential = enrolment.issue_credential(Actor(system="test"), "outage", address="127.0.0.1")
    with httpx.Client(base_url=web.base_url, headers={"Authorization": f"Bearer {credential}"}, timeout=30) as client:
        assert client.get("/api/node/self/").status_code == 200

        database_proxy.refuse()  # the open connections are cut, new ones refused
        started = time.monotonic()
        away = client.get("/api/node/self/")
        assert away.status_code == 503, away.text
        assert away.json()["error"]["code"] == "database_unavailable" and away.headers["Retry-After"] == "5"
        assert time.monotonic() - started < 15, "a database away must be an error within seconds"

        database_proxy.restore()
        wait_until(lambda: client.get("/healthz").status_code == 200, 30, what="the web process answering")
        assert client.get("/api/node/self/").status_code == 200
