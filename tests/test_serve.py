"""`manage.py serve`: web, worker, beat and agent run as one group: each is restarted when it exits,
the others run on, a database outage is waited out, and Ctrl-C or SIGTERM stops them all."""

import io
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from django.core.management.color import no_style
from django.db import OperationalError, connection

from berth.management.commands import serve
from berth.supervisor import Supervisor
from tests.assets.database import database_environ, through
from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.django_db(transaction=True)
def test_serve_runs_web_worker_and_beat_and_ctrl_c_stops_them_all(tmp_path):
    db = connection.settings_dict
    environment = dict(os.environ, **database_environ(db))
    port = free_port()
    output = tmp_path / "serve.log"
    with open(output, "w") as log:
        group = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port), "--concurrency", "1"],
                                 cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
        try:
            def ready():
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(ready, 90, what="/readyz of the served web process")
            wait_until(lambda: "Berth console: http://127.0.0.1:" in output.read_text(), 30, what="console URL printed")
            wait_until(lambda: "control@" in output.read_text() and " ready." in output.read_text(), 90,
                       what="the Celery worker ready")
            text = output.read_text()
            pids = {name: int(pid) for name, pid in re.findall(r"started (\w+) \(pid (\d+)\)", text)}
            assert set(pids) == {"web", "worker", "batches", "beat", "agent"}
            group.send_signal(signal.SIGINT)  # what Ctrl-C delivers
            assert group.wait(timeout=60) == 0, output.read_text()[-3000:]
        finally:
            if group.poll() is None:
                group.kill()
                group.wait()
    assert all(_gone(pid) for pid in pids.values())
    assert "stopping: SIGINT" in output.read_text()


def test_a_program_that_ignores_sigterm_is_killed_after_the_grace_period():
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"]
    out = io.StringIO()
    supervisor = Supervisor({"stubborn": stubborn}, grace=1, out=out)
    supervisor.start()
    wait_until(lambda: "stubborn | up" in out.getvalue(), 30, what="stubborn ignoring SIGTERM")
    supervisor.request_stop("test")
    supervisor.wait()
    assert supervisor.processes["stubborn"].returncode == -signal.SIGKILL


def _started(text: str) -> dict[str, list[int]]:
    """Every PID each program has had, in order (a restart adds one)."""
    pids: dict[str, list[int]] = {}
    for name, pid in re.findall(r"started (\w+) \(pid (\d+)", text):
        pids.setdefault(name, []).append(int(pid))
    return pids


def _get(port: int, path: str) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/{path}", timeout=5).status_code


def _readyz(port: int) -> bool:
    try:
        return _get(port, "readyz") == 200
    except httpx.HTTPError:
        return False


@contextmanager
def _serving(tmp_path, **environ):
    """`manage.py serve` (one worker process) on a free port, up and announced; killed if still running at the end."""
    environment = {**os.environ, **database_environ(connection.settings_dict), **environ}
    port = free_port()
    output = tmp_path / "serve.log"
    with open(output, "w") as log:
        group = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port), "--concurrency", "1"],
                                 cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: _readyz(port), 90, what="/readyz of the served web process")
            wait_until(lambda: "Berth console: http://127.0.0.1:" in output.read_text(), 30, what="console URL printed")
            yield group, output, port
        finally:
            if group.poll() is None:
                group.kill()
                group.wait()


@pytest.mark.django_db(transaction=True)
def test_a_killed_agent_is_restarted_with_its_reason_while_the_web_server_keeps_answering(tmp_path):
    with _serving(tmp_path) as (group, output, port):
        wait_until(lambda: "  agent | " in output.read_text(), 60, what="the agent printing")
        first = _started(output.read_text())
        os.kill(first["agent"][0], signal.SIGKILL)
        answers = []

        def agent_started_again():
            answers.append(_get(port, "healthz"))  # a refused connection would fail the test here
            return len(_started(output.read_text())["agent"]) == 2

        wait_until(agent_started_again, 30, what="the agent started again")
        text = output.read_text()
        assert set(answers) == {200}, answers
        assert re.search(r"agent exited: killed by SIGKILL; last output: .+; starting it again in 1s", text), text[-3000:]
        restarted = _started(text)
        assert restarted["agent"][1] != first["agent"][0] and not _gone(restarted["agent"][1])
        assert all(restarted[name] == first[name] for name in ("web", "worker", "beat")), text[-3000:]
        assert not re.search(r"(web|worker|beat) (exited|keeps exiting)", text)
        assert _get(port, "healthz") == 200
        group.send_signal(signal.SIGINT)
        assert group.wait(timeout=60) == 0, output.read_text()[-3000:]
    assert all(_gone(pid) for pids in _started(output.read_text()).values() for pid in pids)


@pytest.mark.django_db(transaction=True)
def test_serve_waits_out_a_database_that_refuses_and_sigterm_then_stops_everything(tmp_path, database_proxy):
    if connection.vendor == "sqlite":
        pytest.skip("the embedded SQLite file has no connection to refuse; "
                    "test_the_tick_says_once_that_the_database_is_away_and_goes_on covers the tick there")
    with _serving(tmp_path, **through(database_proxy)) as (group, output, port):
        before = _started(output.read_text())
        database_proxy.refuse()
        wait_until(lambda: "The database does not answer" in output.read_text(), 30,
                   what="serve saying the database is away")
        # The outage lasts several of the 2 s ticks; the web server answers throughout.
        outage_until = time.monotonic() + 5
        wait_until(lambda: _get(port, "healthz") == 200 and time.monotonic() > outage_until, 30,
                   what="an outage of five more seconds")
        assert _get(port, "readyz") == 503
        assert group.poll() is None, output.read_text()[-3000:]
        database_proxy.restore()
        wait_until(lambda: "The database answers again" in output.read_text(), 30, what="serve seeing it back")
        wait_until(lambda: _readyz(port), 60, what="/readyz once the database is back")
        text = output.read_text()
        assert text.count("The database does not answer") == 1, text[-3000:]
        assert _started(text)["web"] == before["web"], "the web server was restarted"
        group.send_signal(signal.SIGTERM)
        assert group.wait(timeout=60) == 0, output.read_text()[-3000:]
    text = output.read_text()
    assert "stopping: SIGTERM" in text
    assert all(_gone(pid) for pids in _started(text).values() for pid in pids)
    assert all(f"{name} stopped (status" in text or f"{name} was not running" in text
               for name in ("web", "worker", "beat", "agent"))


@pytest.mark.django_db(transaction=True)  # the tick's close_old_connections() ends a test's atomic block
def test_the_tick_says_once_that_the_database_is_away_and_goes_on(monkeypatch):
    said = []
    announcer = serve.Announcer("http://127.0.0.1:1/", said.append, no_style())
    announcer.check_models()  # the real query: nothing is ready
    assert said == []

    def refused():
        raise OperationalError("connection to server at \"127.0.0.1\", port 5432 failed: Connection refused\n"
                               "\tIs the server running on that host and accepting TCP/IP connections?")

    monkeypatch.setattr(serve, "ready_model_names", refused)
    for _ in range(3):
        announcer.check_models()
    assert said == [("\n  The database does not answer (connection to server at \"127.0.0.1\", port 5432 failed: "
                     "Connection refused); waiting for it. Every program keeps running.\n")]
    monkeypatch.setattr(serve, "ready_model_names", lambda: ["smollm2"])
    announcer.check_models()
    announcer.check_models()
    assert said[1:] == ["\n  The database answers again.\n", "\n  Model smollm2 is ready.\n"]
