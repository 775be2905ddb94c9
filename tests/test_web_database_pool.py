"""The web process pools its PostgreSQL connections. Under ASGI, Django runs each request's sync code
on a thread of its own, so without a pool every console or node-API request connected anew. A real
web process reaches the test database through a TCP proxy that counts its connections, and that the
test cuts and restores: a database away is an error within seconds, and once it is back the very
next request is served (the pool checks a connection before handing it over)."""

from __future__ import annotations

import time

import httpx
import pytest
from django.db import connection

from scheduler import enrolment
from tenancy.audit import Actor
from tests.assets.database import database_environ
from tests.assets.tcp_proxy import TcpProxy
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(connection.vendor != "postgresql",
                                 reason="a pool of PostgreSQL connections: SQLite opens a file, and pools nothing")]


@pytest.fixture
def proxy():
    db = connection.settings_dict
    proxy = TcpProxy(int(db["PORT"] or 5432), db["HOST"] or "127.0.0.1")
    yield proxy
    proxy.close()


@pytest.fixture
def web(proxy, artifacts_dir):
    process = GatewayProcess(artifacts_dir / "web-database-pool.log",
                             environ=database_environ(connection.settings_dict, host=proxy.host, port=proxy.port))
    yield process
    process.stop()


def test_requests_share_the_pools_connections_and_ride_out_a_database_restart(web, proxy):
    credential = enrolment.issue_credential(Actor(system="test"), "pooled", address="127.0.0.1")
    headers = {"Authorization": f"Bearer {credential}"}
    with httpx.Client(base_url=web.base_url, headers=headers, timeout=30) as client:
        assert client.get("/api/node/self/").status_code == 200
        before = proxy.accepted
        answers = [client.get("/api/node/self/").status_code for _ in range(40)]
        assert answers == [200] * 40
        # One connection a request before the pool; a few now (the gateway's own readers among them).
        assert proxy.accepted - before <= 4, f"{proxy.accepted - before} connections for 40 requests"

        proxy.refuse()  # the open connections are cut, new ones refused
        started = time.monotonic()
        away = client.get("/api/node/self/")
        assert away.status_code == 500 and away.json()["error"]["code"] == "internal_error"
        assert time.monotonic() - started < 15, "a database away must be an error within seconds"

        proxy.restore()
        # The pool's connections died with the cut; each is checked before it is handed over, so the
        # first request once the database answers again is served.
        wait_until(lambda: client.get("/healthz").status_code == 200, 30, what="the web process answering")
        assert client.get("/api/node/self/").status_code == 200
