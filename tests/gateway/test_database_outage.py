"""The gateway while PostgreSQL refuses it: a real gateway process reaches the test database through
a TCP proxy the test cuts and restores (the test itself reaches the database directly). Known keys
ride the outage out for a bounded time, keys never seen are answered 503 with Retry-After, a
revocation heard meanwhile still applies, nothing is a 500, and once the database is back every
request served during the outage has its usage record."""

from __future__ import annotations

import itertools
import time
import uuid

import httpx
import pytest
from django.db import connection

from gateway.models import UsageRecord
from gateway.tasks import retry_usage
from tenancy.services import clients
from tests.assets.database import through
from tests.assets.waiting import wait_until
from tests.gateway.conftest import GatewayProcess

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(connection.vendor != "postgresql",
                                 reason="a database outage needs a database server to cut off: SQLite is a file")]

CACHE_SECONDS = 1  # a key's reading is fresh this long...
STALE_SECONDS = 12  # ...and trusted this much longer while the database cannot be asked


@pytest.fixture
def gateway_via_proxy(database_proxy, artifacts_dir):
    process = GatewayProcess(artifacts_dir / "gateway-db-outage.log", environ=through(database_proxy),
                             auth_cache_seconds=CACHE_SECONDS, auth_stale_seconds=STALE_SECONDS)
    yield process
    process.stop()


def test_known_keys_ride_out_a_database_outage_and_unknown_ones_get_503(gateway_via_proxy, database_proxy, tiny_engine,
                                                                        deploy, make_key, tree):
    gateway = gateway_via_proxy
    deploy("tiny", tiny_engine, task="completion")
    known, revoked_meanwhile, unseen = make_key(), make_key(), make_key()
    run = uuid.uuid4().hex[:8]
    served: list[str] = []  # request ids answered 200
    numbers = itertools.count()

    def ask(key, phase: str) -> httpx.Response:
        request_id = f"{run}-{phase}-{next(numbers)}"
        answer = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30,
                            headers={"Authorization": f"Bearer {key.key}", "X-Request-Id": request_id},
                            json={"model": "tiny", "prompt": "a", "max_tokens": 1})
        assert answer.status_code != 500, answer.text
        if answer.status_code == 200:
            served.append(request_id)
        return answer

    def code(answer: httpx.Response) -> str:
        return answer.json()["error"]["code"]

    first_read = time.monotonic()  # the known key's last reading before the outage is no older than this
    wait_until(lambda: ask(known, "before").status_code == 200, 30, what="the gateway serving tiny")
    assert ask(revoked_meanwhile, "before").status_code == 200

    database_proxy.refuse()
    outage_began = len(served)

    # The known key's reading expires within a second; the database is asked, refuses, and the key is
    # served from its last reading (the log says so).
    def served_from_last_reading() -> bool:
        answer = ask(known, "outage")
        assert answer.status_code == 200, answer.text
        return "from their last reading" in gateway.log()

    wait_until(served_from_last_reading, 30, interval=0.2, what="the known key served from its last reading")

    # A key the gateway never saw cannot be checked: 503 with Retry-After, never 500.
    answer = ask(unseen, "outage-unseen")
    assert answer.status_code == 503 and code(answer) == "database_unavailable", answer.text
    assert int(answer.headers["retry-after"]) >= 1

    # Revoked meanwhile (the test reaches the database itself): the gateway hears it over Redis and
    # stops trusting its reading at once, although it cannot read the key again.
    clients.revoke_credential(tree.actor, revoked_meanwhile.credential)
    answer = ask(revoked_meanwhile, "outage-revoked")
    assert answer.status_code == 503 and code(answer) == "database_unavailable", answer.text

    # The trust is bounded: past the stale window the known key is refused like an unseen one.
    def refused_at_last() -> httpx.Response | None:
        answer = ask(known, "outage-late")
        assert answer.status_code in (200, 503), answer.text
        return answer if answer.status_code == 503 else None

    late = wait_until(refused_at_last, STALE_SECONDS + 15, interval=0.5, what="the stale window ending")
    assert code(late) == "database_unavailable" and int(late.headers["retry-after"]) >= 1
    assert time.monotonic() - first_read >= CACHE_SECONDS + STALE_SECONDS  # not before the window ended
    during = served[outage_began:]
    assert len(during) >= 2

    database_proxy.restore()
    wait_until(lambda: ask(unseen, "after").status_code == 200, 30, interval=0.5,
               what="the unseen key served once the database is back")
    assert ask(known, "after").status_code == 200
    answer = ask(revoked_meanwhile, "after")
    assert answer.status_code == 401 and code(answer) == "api_key_revoked", answer.text

    # Usage of what was served while the database refused it was parked (the log says so) and is
    # written by the retry task, as beat runs it every minute.
    wait_until(lambda: "parked for retry" in gateway.log(), 20, what="usage parked during the outage")

    def all_written() -> bool:
        retry_usage()
        return set(UsageRecord.objects.filter(request_id__in=served).values_list("request_id", flat=True)) == set(served)

    wait_until(all_written, 30, interval=0.5, what="every served request's usage record")
