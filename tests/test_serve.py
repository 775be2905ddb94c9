"""`manage.py serve`: web, worker and beat run as one group that stops together."""

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.db import connection

from berth.supervisor import Supervisor
from tests.assets.database import database_environ
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
            assert set(pids) == {"web", "worker", "beat", "agent"}
            group.send_signal(signal.SIGINT)  # what Ctrl-C delivers
            assert group.wait(timeout=60) == 0, output.read_text()[-3000:]
        finally:
            if group.poll() is None:
                group.kill()
                group.wait()
    assert all(_gone(pid) for pid in pids.values())
    assert "stopping: SIGINT" in output.read_text()


def test_a_program_that_dies_brings_the_group_down_with_its_status():
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    crasher = [sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(3)"]
    out = io.StringIO()
    supervisor = Supervisor({"sleeper": sleeper, "crasher": crasher}, grace=10, out=out)
    status = supervisor.run()
    assert status == 3
    assert supervisor.stop_reason == "crasher exited with status 3"
    assert all(process.poll() is not None for process in supervisor.processes.values())
    assert "crasher | boom" in out.getvalue()


def test_a_program_that_ignores_sigterm_is_killed_after_the_grace_period():
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"]
    out = io.StringIO()
    supervisor = Supervisor({"stubborn": stubborn}, grace=1, out=out)
    supervisor.start()
    wait_until(lambda: "stubborn | up" in out.getvalue(), 30, what="stubborn ignoring SIGTERM")
    supervisor.request_stop("test")
    assert supervisor.wait() == 0
    assert supervisor.processes["stubborn"].returncode == -signal.SIGKILL
