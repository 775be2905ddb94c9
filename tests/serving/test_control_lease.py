"""The control loop's lease (berth.lease, taken by serving.control.reconcile.run): one process runs the
periodic pass; it renews the lease each pass and holds it until three passes are missed; a contender
skips the pass and says so in its log, and takes over once the lease has expired. /readyz and /metrics
show the holder (host:pid) and how long it has held it. In the database, so the embedded default
(no Redis) has it too.

Time is driven by writing old values: a lease three missed passes old is one whose expiry has passed."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.core.cache import cache
from django.db import connection
from django.db.models.functions import Now
from prometheus_client.parser import text_string_to_metric_families

from berth import health, lease
from berth.celery import app
from berth.models import Lease
from gateway import fleet_metrics
from serving.control import reconcile
from tests.assets.database import database_environ
from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db(transaction=True)  # other processes and threads read what is written

# One pass of the loop in another process: it prints its own name as the lease knows it.
PASS_ELSEWHERE = ("from berth import lease; from serving.control import reconcile; "
                  "print('RAN', reconcile.run(), lease.identity(), flush=True)")


def _expire(seconds_ago: float = 1) -> None:
    """As if the holder missed three passes: its lease expired ``seconds_ago``."""
    Lease.objects.filter(name=lease.CONTROL_LOOP).update(expires_at=Now() - timedelta(seconds=seconds_ago))


def _pass_elsewhere() -> tuple[str, str]:
    """A pass run by another process of Berth on this database: (its holder name, its output)."""
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", PASS_ELSEWHERE], cwd=ROOT,
                          env={**os.environ, **database_environ(connection.settings_dict)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    holder = re.search(r"^RAN \d+ (\S+)$", done.stdout, re.M).group(1)
    return holder, done.stdout + done.stderr


def _loop_detail(client) -> dict:
    return client.get("/readyz").json()["details"]["control_loop"]


def _lease_series() -> dict:
    text = fleet_metrics.render().decode()
    return {(s.name, s.labels.get("holder")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("berth_control_lease")}


def test_of_two_contenders_racing_each_round_exactly_one_holds_the_lease():
    """Two threads, each its own database connection, claim at the same moment, round after round:
    on the first round both find no row (the INSERT decides), on the others the lease has just
    expired (the conditional UPDATE decides). Never both, never neither."""
    outcomes = []
    for _ in range(12):
        barrier, won, errors = threading.Barrier(2), {}, []

        def contend(holder: str) -> None:
            try:
                barrier.wait(timeout=30)
                won[holder] = lease.claim(lease.CONTROL_LOOP, holder, 45)[0]
            except Exception as exc:  # noqa: BLE001 - reported below, with the thread's name
                errors.append((holder, exc))
            finally:
                connection.close()  # this thread's own connection

        threads = [threading.Thread(target=contend, args=(holder,)) for holder in ("host-a:1", "host-b:2")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        assert sorted(won.values()) == [False, True], won
        winner = next(holder for holder, took in won.items() if took)
        assert lease.read(lease.CONTROL_LOOP).holder == winner
        outcomes.append(winner)
        _expire()
    assert len(outcomes) == 12


def test_the_holder_renews_and_a_contender_is_refused_until_three_passes_are_missed():
    assert reconcile.lease_seconds() == 3 * health.pass_interval() == 45
    first, held = lease.claim(lease.CONTROL_LOOP, "host-a:1", reconcile.lease_seconds())
    assert first and held.holder == "host-a:1" and not held.expired
    taken_at = held.acquired_at
    refused, held = lease.claim(lease.CONTROL_LOOP, "host-b:2", 45)
    assert not refused and held.holder == "host-a:1"
    renewed, held = lease.claim(lease.CONTROL_LOOP, "host-a:1", 45)
    assert renewed and held.acquired_at == taken_at and held.renewed_at >= taken_at  # held since the first claim
    assert 44 <= (held.expires_at - held.now).total_seconds() <= 45
    _expire()
    taken, held = lease.claim(lease.CONTROL_LOOP, "host-b:2", 45)
    assert taken and held.holder == "host-b:2" and held.acquired_at > taken_at
    assert lease.release(lease.CONTROL_LOOP, "host-a:1") is False  # no longer its to give up
    assert lease.release(lease.CONTROL_LOOP, "host-b:2") is True
    assert lease.claim(lease.CONTROL_LOOP, "host-a:1", 45)[0]  # given up: taken at once


def test_a_worker_stopping_cleanly_hands_the_lease_over_at_once():
    from serving import tasks

    assert reconcile.lead()  # this process holds it
    tasks._hand_over_lease()  # what a control worker's worker_shutdown signal runs
    held = lease.read(lease.CONTROL_LOOP)
    assert held.holder == lease.identity() and held.expired
    assert lease.claim(lease.CONTROL_LOOP, "host-b:2", 45)[0]  # taken at once, not three passes later


def test_a_pass_in_another_process_takes_the_lease_and_this_one_skips_saying_so(client, caplog):
    """A second process is a contender: its pass is skipped, the log names the holder, the loop's
    last pass is not marked by it; once the lease expires it takes over, and /readyz and /metrics
    show whoever holds it, for how long."""
    elsewhere, output = _pass_elsewhere()
    me = lease.identity()
    assert elsewhere != me and elsewhere.split(":")[0] == socket.gethostname()
    assert "control loop lease taken by " + elsewhere in output
    detail = _loop_detail(client)
    assert detail["holder"] == elsewhere and detail["lease_expired"] is False
    assert 0 <= detail["lease_age_s"] < 60 and detail["lease_renewed_age_s"] <= detail["lease_age_s"]
    assert _lease_series()[("berth_control_lease_held", elsewhere)] == 1

    cache.set(health.LAST_PASS_KEY, 1_000.0, None)  # a pass by this process would write the time
    with caplog.at_level(logging.INFO, logger="serving.control.reconcile"):
        assert reconcile.run() == 0
    assert f"control loop pass skipped: its lease is held by {elsewhere}" in caplog.text
    assert cache.get(health.LAST_PASS_KEY) == 1_000.0  # it did not pass
    assert lease.read(lease.CONTROL_LOOP).holder == elsewhere

    _expire(seconds_ago=5)  # the other process stopped: three passes missed
    assert _loop_detail(client)["lease_expired"] is True
    assert _lease_series()[("berth_control_lease_held", elsewhere)] == 0  # the old holder's series goes 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="serving.control.reconcile"):
        reconcile.run()
    assert f"control loop lease taken over by {me} from {elsewhere}, whose lease expired" in caplog.text
    assert time.time() - cache.get(health.LAST_PASS_KEY) < 60  # this time it passed
    detail = _loop_detail(client)
    assert (detail["holder"], detail["lease_expired"]) == (me, False)
    series = _lease_series()
    assert series[("berth_control_lease_held", me)] == 1 and 0 <= series[("berth_control_lease_age_seconds", me)] < 60

    again, output = _pass_elsewhere()  # a contender again, now that this process holds it
    assert f"control loop pass skipped: its lease is held by {me}" in output
    assert lease.read(lease.CONTROL_LOOP).holder == me


def test_readyz_shows_no_holder_before_the_loop_first_took_the_lease(client):
    cache.set(health.LAST_PASS_KEY, time.time(), None)
    detail = _loop_detail(client)
    assert (detail["holder"], detail["lease_age_s"], detail["lease_expired"]) == (None, None, None)
    assert not _lease_series()  # absent, not a holder named ""


# --- the real thing: `manage.py serve` twice, each with its own beat and a pooled worker -----------------

class Served:
    """``manage.py serve --no-agent`` (web, a prefork worker of two children, beat) on the test database."""

    def __init__(self, tmp_path: Path, name: str):
        self.port, self.log_path = free_port(), tmp_path / f"serve-{name}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(self.port), "--concurrency", "2", "--no-agent"],
            cwd=ROOT, env={**os.environ, **database_environ(connection.settings_dict)}, stdout=self._log,
            stderr=subprocess.STDOUT)
        self.worker_pid = int(wait_until(lambda: self._worker_pid(), 90, what=f"{name}'s worker started"))
        self.holder = f"{socket.gethostname()}:{self.worker_pid}"

    def _worker_pid(self):
        if self.process.poll() is not None:
            raise RuntimeError(f"serve exited: {self.text()[-3000:]}")
        found = re.search(r"started worker \(pid (\d+)\)", self.text())
        return found and found.group(1)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        """Its control worker consumes the queue (Celery says so once it is connected and synced)."""
        return "control@" in self.text() and " ready." in self.text()

    def loop(self) -> dict | None:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=5).json()["details"]["control_loop"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _tail(served: Served) -> str:
    return "\n".join(line for line in served.text().splitlines()[-60:] if "GET /readyz" not in line)


@pytest.mark.timeout(600)  # each step waits on starting processes: their bounds add up past the default
def test_two_served_control_planes_run_the_loop_once_and_hand_over_when_the_holder_stops(tmp_path):
    """Two `serve` groups on one database: two beats, two pooled workers. The lease names the first
    worker by its own pid (the pool's children are the same holder: they never contend with each
    other); the second worker skips the passes it is given and says whose lease it is; once the first
    stops and its lease runs out, the second takes over."""
    app.control.purge()  # tasks other tests left on the shared broker's queue are not these workers' passes
    first = Served(tmp_path, "first")
    second = None
    try:
        wait_until(lambda: (first.loop() or {}).get("holder") == first.holder, 90,
                   what="the first worker holding the lease")
        second = Served(tmp_path, "second")
        wait_until(second.ready, 90, what="the second worker consuming the queue")
        # Both beats send a pass every 15 s onto the one queue both workers share: the second is given
        # one within a few passes (the broker hands each message to one of the waiting workers).
        try:
            wait_until(lambda: f"control loop pass skipped: its lease is held by {first.holder}" in second.text(),
                       180, what="the second worker skipping a pass")
        except TimeoutError as timeout:
            raise AssertionError(f"{timeout}\nthe second's log:\n{_tail(second)}\nthe first's:\n{_tail(first)}") \
                from timeout
        assert (second.loop() or {}).get("holder") == first.holder  # either web process shows the same holder
        assert "skipped" not in first.text()  # the holder's pool children never skip each other's passes
        first.stop()
        _expire()  # as three missed passes would
        wait_until(lambda: (second.loop() or {}).get("holder") == second.holder, 60,
                   what="the second worker taking the lease over")
        assert f"control loop lease taken over by {second.holder} from {first.holder}" in second.text()
        assert (second.loop() or {}).get("lease_expired") is False
    finally:
        first.stop()
        if second is not None:
            second.stop()
