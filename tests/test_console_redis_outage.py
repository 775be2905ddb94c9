"""The console and the API while Redis is down: a real web process whose Redis (the cache, the
broker, the live events) is a private ``redis-server`` this test starts and then stops. Every page
still answers; the memory banner says the levels are unknown rather than failing the page."""

from __future__ import annotations

import subprocess

import httpx
import pytest
from django.test import Client

from tenancy.services import clients
from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until
from tests.assets.world import MARKER, build_world
from tests.gateway.conftest import GatewayProcess
from tests.test_console_walk import ROUTES, Page, url_of

pytestmark = pytest.mark.django_db(transaction=True)

UNKNOWN = "Memory levels are unknown"


class PrivateRedis:
    """``redis-server`` on a free loopback port, keeping nothing on disk, stopped by its PID."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
                                         "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.answers, 20, what="the private Redis answering")

    def answers(self) -> bool:
        import redis

        try:
            return redis.Redis.from_url(self.url, socket_timeout=1).ping()
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def private_redis():
    server = PrivateRedis()
    yield server
    server.stop()


def session_cookie(user) -> dict:
    client = Client()
    client.force_login(user)  # a session row in the database: the web process reads the same one
    return {"sessionid": client.cookies["sessionid"].value}


def test_every_console_page_and_the_api_answer_while_redis_is_down(personas, private_redis, artifacts_dir,
                                                                   admin_user):
    world = build_world(personas)
    client = clients.create_client(personas.olivia_actor, personas.acme.project, "outage-bot", all_models=True)
    key = clients.create_credential(personas.olivia_actor, client)[1]
    owner = httpx.Client(cookies=session_cookie(personas.olivia), timeout=30)
    staff = httpx.Client(cookies=session_cookie(admin_user), timeout=30)
    web = GatewayProcess(artifacts_dir / "web-redis-outage.log",
                         environ={"REDIS_URL": private_redis.url, "HF_ENDPOINT": "http://127.0.0.1:9"})
    owner.base_url = staff.base_url = web.base_url
    try:
        pages = {route: spec for route, spec in ROUTES.items()
                 if isinstance(spec, Page) and not route.endswith("/stream/")}  # a live stream never ends

        def walk() -> dict[str, tuple[int, str]]:
            answers = {}
            for route, spec in sorted(pages.items()):
                url = url_of(route, spec, world)
                response = (staff if spec.staff_only else owner).get(url, params=spec.query(world) if spec.query
                                                                     else None)
                answers[url] = (response.status_code, response.text)
                assert response.status_code in spec.answers, (url, response.status_code, response.text[:300])
            return answers

        before = walk()  # with Redis up: every page as the console walk expects it
        assert not [url for url, (_, text) in before.items() if UNKNOWN in text]

        private_redis.stop()
        assert not private_redis.answers()

        during = walk()  # see web-redis-outage.log for a page that fails
        assert {url: status for url, (status, _) in during.items() if status != before[url][0]} == {}
        pages_with_banner = [url for url, (_, text) in during.items() if "</header>" in text]
        assert len(pages_with_banner) > 10 and "/" in pages_with_banner and "/models/" in pages_with_banner
        assert [url for url in pages_with_banner if UNKNOWN not in during[url][1]] == []
        # The management API (JSON, no banner) and the gateway's listing of models answer too.
        for url in ("/api/", "/api/serving/deployments/", "/api/scheduler/nodes/", "/api/tenancy/scopes/"):
            response = owner.get(url)
            assert response.status_code == 200, (url, response.text[:300])
        listing = httpx.get(f"{web.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert listing.status_code == 200 and f"{MARKER}-model" in listing.text, listing.text[:300]
    finally:
        web.stop()
        for http in (owner, staff):
            http.close()
