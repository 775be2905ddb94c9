"""The web process pools its PostgreSQL connections. Under ASGI, Django runs each request's sync code
on a thread of its own, so without a pool every console or node-API request connected anew. A real
web process reaches the test database through a TCP proxy that counts its connections, and that the
test cuts and restores: a database away is an error within seconds, and once it is back the very
next request is served (the pool checks a connection before handing it over). While it is away, the
API answers 503 ``database_unavailable`` with Retry-After, as the gateway does."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis
from django.conf import settings
from django.db import connection

from scheduler import enrolment
from scheduler.models import Node
from serving import queues
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
        away = client.get("/api/node/self/")  # an API says plainly it cannot answer now, and when to ask again
        assert away.status_code == 503, away.text
        assert away.json()["error"]["code"] == "database_unavailable" and away.headers["Retry-After"] == "5"
        assert time.monotonic() - started < 15, "a database away must be an error within seconds"

        proxy.restore()
        # The pool's connections died with the cut; each is checked before it is handed over, so the
        # first request once the database answers again is served.
        wait_until(lambda: client.get("/healthz").status_code == 200, 30, what="the web process answering")
        assert client.get("/api/node/self/").status_code == 200


@pytest.mark.skipif(not settings.REDIS_URL, reason="waiting claims are counted as their Redis subscriptions")
def test_claims_waiting_for_work_hold_none_of_the_pools_connections(proxy, artifacts_dir):
    web = GatewayProcess(artifacts_dir / "web-database-pool-small.log", environ={
        **database_environ(connection.settings_dict, host=proxy.host, port=proxy.port),
        "BERTH_DATABASE_POOL_SIZE": "2"})
    try:
        credential = enrolment.issue_credential(Actor(system="test"), "waiting", address="127.0.0.1")
        headers = {"Authorization": f"Bearer {credential}"}
        channel = queues.node_jobs_channel(Node.objects.get(name="waiting").pk)
        answers: list[int] = []

        def claim():
            answers.append(httpx.post(f"{web.base_url}/api/node/jobs/claim/", json={"wait": 8}, headers=headers,
                                      timeout=30).status_code)

        claims = [threading.Thread(target=claim) for _ in range(4)]  # as many as an agent keeps waiting
        for thread in claims:
            thread.start()
        subscribers = redis.Redis.from_url(settings.REDIS_URL)
        wait_until(lambda: subscribers.pubsub_numsub(channel)[0][1] == 4, 30, what="four claims waiting")
        # Twice the pool's size waits; another request is answered at once, not after the pool's timeout.
        started = time.monotonic()
        assert httpx.get(f"{web.base_url}/api/node/self/", headers=headers, timeout=30).status_code == 200
        assert time.monotonic() - started < 2
        for thread in claims:
            thread.join(30)
        assert answers == [204] * 4
    finally:
        web.stop()
