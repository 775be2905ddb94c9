"""Login throttling per account and per address, with bounded memory a flood cannot wash out, and
password hashing in a bounded number of slots."""

import pytest
import redis
from django.conf import settings

from tenancy import backends, throttle
from tenancy.errors import Busy
from tenancy.throttle import LoginThrottle


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


@pytest.fixture(params=["memory", "redis"])
def make_throttle(request):
    made = []

    def make(**options):
        clock = Clock()
        url = settings.REDIS_URL if request.param == "redis" else None
        limiter = LoginThrottle(options.get("max_failures", 5), 900, options.get("capacity", 100), url, clock=clock)
        made.append(limiter)
        return limiter, clock

    yield make
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("berth:login:*"):
        client.delete(key)


def test_an_account_is_blocked_after_its_failures(make_throttle):
    limiter, _ = make_throttle()
    for number in range(5):
        assert not limiter.blocked("ada", f"127.0.0.{number + 1}")
        limiter.failed("ada", f"127.0.0.{number + 1}")
    assert limiter.blocked("ADA ", "127.0.0.99")  # account names compare trimmed and case-blind
    assert not limiter.blocked("bob", "127.0.0.99")


def test_an_address_is_blocked_after_guessing_many_accounts(make_throttle):
    limiter, _ = make_throttle()
    for number in range(5):
        limiter.failed(f"user{number}", "127.0.0.7")
    assert limiter.blocked("someone-else", "127.0.0.7")
    assert not limiter.blocked("someone-else", "127.0.0.8")


def test_a_flood_of_invented_addresses_does_not_evict_the_guessing_address(make_throttle):
    limiter, _ = make_throttle(capacity=100)
    for _ in range(4):
        limiter.failed("ada", "127.0.0.7")
    for number in range(2000):  # twenty times the table's capacity, one failure each
        limiter.failed(f"user{number}", f"::{number + 1}")
    assert limiter.tables.count(limiter._table("address"), "127.0.0.7") == 4
    limiter.failed("bob", "127.0.0.7")
    assert limiter.blocked("carol", "127.0.0.7")


def test_memory_stays_bounded(make_throttle):
    limiter, _ = make_throttle(capacity=100)
    for number in range(1000):
        limiter.failed(f"user{number}", f"::{number + 1}")
    tables = limiter.tables
    if isinstance(tables, throttle._MemoryTables):
        assert all(len(counts) <= 100 for counts in tables._tables.values())
    else:
        assert tables.client.zcard(limiter._table("address")) <= 100


def test_counters_reset_with_the_next_window(make_throttle):
    limiter, clock = make_throttle()
    for _ in range(5):
        limiter.failed("ada", "127.0.0.1")
    assert limiter.blocked("ada", "127.0.0.1")
    clock.now += 900
    assert not limiter.blocked("ada", "127.0.0.1")


def test_success_clears_the_accounts_counter(make_throttle):
    limiter, _ = make_throttle()
    for _ in range(4):
        limiter.failed("ada", "127.0.0.1")
    limiter.succeeded("ada", "127.0.0.1")
    limiter.failed("ada", "127.0.0.2")
    assert not limiter.blocked("ada", "127.0.0.3")


@pytest.mark.django_db
def test_console_login_refuses_even_the_right_password_once_throttled(client, django_user_model, monkeypatch,
                                                                    argon2_hashing):
    monkeypatch.setattr(throttle, "_throttle", LoginThrottle(3, 900, 100, None))
    assert django_user_model.objects.create_user("ada", password="the-right-password-42").password.startswith("argon2$")
    for _ in range(3):
        response = client.post("/login/", {"username": "ada", "password": "wrong"}, REMOTE_ADDR="127.0.0.5")
        assert "do not match" in response.content.decode()
    response = client.post("/login/", {"username": "ada", "password": "the-right-password-42"}, REMOTE_ADDR="127.0.0.6")
    assert response.status_code == 200
    assert "Too many failed logins" in response.content.decode()
    assert "_auth_user_id" not in client.session


@pytest.mark.django_db
def test_password_hashing_waits_for_a_free_slot_and_refuses_when_none_frees(django_user_model, monkeypatch,
                                                                          argon2_hashing):
    # The slots bound Argon2's memory: the hash checked here is a real Argon2 one.
    assert django_user_model.objects.create_user("ada", password="the-right-password-42").password.startswith("argon2$")
    monkeypatch.setattr(backends, "_slots", None)
    monkeypatch.setattr(settings, "PASSWORD_HASH_SLOTS", 2)
    monkeypatch.setattr(backends, "SLOT_WAIT_SECONDS", 0.05)
    slots = backends.hashing_slots()
    backend = backends.BoundedHashingBackend()
    assert slots.acquire(timeout=1) and slots.acquire(timeout=1)  # a flood holds every slot
    with pytest.raises(Busy):
        backend.authenticate(None, username="ada", password="the-right-password-42")
    slots.release()
    assert backend.authenticate(None, username="ada", password="the-right-password-42").username == "ada"
    slots.release()
