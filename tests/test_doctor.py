"""`manage.py doctor`: each check's verdict, finding and advice; a missing engine, a stopped broker and a
silent control loop are reported as failures with what to do; --json carries every check."""

import json
import os
import socket
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from berth import health
from berth.celery import app as celery_app
from berth.management.commands import doctor
from serving.runtimes.base import Handle
from serving.node.client import Credential
from tests.assets.database import database_environ

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["database", "broker", "control_loop", "engines", "gpus", "model_roots", "clock_skew", "engine_listeners",
         "node_credential"]


def _doctor(*args) -> tuple[dict, bool]:
    """The --json report, and whether the command failed."""
    out = StringIO()
    try:
        call_command("doctor", "--json", *args, stdout=out)
        failed = False
    except CommandError:
        failed = True
    return json.loads(out.getvalue()), failed


def _by_name(report: dict) -> dict:
    return {check["name"]: check for check in report["checks"]}


def test_json_is_valid_and_carries_every_check_with_a_verdict():
    cache.set(health.LAST_PASS_KEY, time.time(), None)
    report, _ = _doctor()
    checks = _by_name(report)
    assert list(checks) == NAMES
    for check in report["checks"]:
        assert check["verdict"] in {"ok", "warning", "failed"}
        assert check["found"]
    assert checks["database"]["verdict"] == "ok"
    assert checks["broker"]["verdict"] == "ok"
    assert checks["control_loop"]["verdict"] == "ok"
    assert checks["clock_skew"]["verdict"] == "ok"  # the same machine's clock
    assert checks["gpus"]["verdict"] == "ok"  # no NVML on this machine is "no GPU found", not a failure
    assert report["ok"] == all(c["verdict"] != "failed" for c in report["checks"])


def test_a_missing_engine_fails_with_the_build_command(settings, tmp_path):
    settings.ENGINE_CACHE_DIR = tmp_path / "empty"
    report, failed = _doctor()
    engines = _by_name(report)["engines"]
    assert failed and report["ok"] is False
    assert engines["verdict"] == "failed"
    assert str(tmp_path / "empty") in engines["found"]
    assert "manage.py engines build llamacpp" in engines["advice"]


def test_a_stopped_broker_fails_with_advice_to_start_it():
    reachable = celery_app.conf.broker_url
    celery_app.conf.broker_url = "redis://127.0.0.1:9/0"  # the discard port: nothing listens there
    try:
        report, failed = _doctor()
    finally:
        celery_app.conf.broker_url = reachable
    broker = _by_name(report)["broker"]
    assert failed
    assert broker["verdict"] == "failed"
    assert "Start Redis" in broker["advice"]


def test_a_silent_control_loop_fails_with_advice_to_start_beat():
    cache.set(health.LAST_PASS_KEY, time.time() - 46, None)  # three passes of 15 s missed
    report, failed = _doctor()
    loop = _by_name(report)["control_loop"]
    assert failed
    assert loop["verdict"] == "failed"
    assert "3 missed passes" in loop["found"]
    assert "beat" in loop["advice"]
    cache.delete(health.LAST_PASS_KEY)
    loop = _by_name(_doctor()[0])["control_loop"]
    assert loop["verdict"] == "failed" and "no pass was ever recorded" in loop["found"]


def test_an_engine_listening_on_every_address_is_a_failure():
    wide, narrow = socket.socket(), socket.socket()
    try:
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        narrow.bind(("127.0.0.1", 0))
        narrow.listen()
        me = Handle(runtime="process", replica_id="r-1", pid=os.getpid())
        found = doctor.listening_sockets(os.getpid())
        assert ("0.0.0.0", wide.getsockname()[1]) in found
        assert ("127.0.0.1", narrow.getsockname()[1]) in found
        check = doctor.engine_listeners([me])
        assert check["verdict"] == "failed"
        assert f"0.0.0.0:{wide.getsockname()[1]}" in check["advice"]
    finally:
        wide.close()
    check = doctor.engine_listeners([me])
    narrow.close()
    assert check["verdict"] == "ok"


@pytest.mark.django_db(transaction=True)
def test_doctor_as_a_subprocess_exits_non_zero_when_the_broker_is_down():
    environment = {**os.environ, **database_environ(connection.settings_dict), "REDIS_URL": "redis://127.0.0.1:9/0"}
    result = subprocess.run([sys.executable, "manage.py", "doctor", "--json"], cwd=ROOT, env=environment, check=False,
                            capture_output=True, text=True, timeout=120)
    checks = _by_name(json.loads(result.stdout))
    assert result.returncode == 1, result.stderr
    assert list(checks) == NAMES
    assert checks["broker"]["verdict"] == "failed"
    assert checks["database"]["verdict"] == "ok"


@pytest.mark.django_db(transaction=True)
def test_a_nodes_credential_is_checked_against_the_server_that_issued_it(settings, tmp_path, live_server):
    from scheduler import enrolment
    from scheduler.models import Node
    from tenancy.audit import Actor
    from tests.assets.agent import issue_credential

    settings.NODE_CREDENTIAL_FILE = tmp_path / "credential"
    missing = doctor.node_credential()
    assert missing["verdict"] == "warning" and "manage.py agent --server" in missing["advice"]

    issue_credential(settings.NODE_CREDENTIAL_FILE, live_server.url, "doctor-node")
    found = doctor.node_credential()
    assert found["verdict"] == "ok" and "doctor-node" in found["found"], found

    settings.NODE_CREDENTIAL_FILE.chmod(0o644)
    assert doctor.node_credential()["verdict"] == "failed"
    settings.NODE_CREDENTIAL_FILE.chmod(0o600)

    enrolment.revoke(Actor(system="tests"), Node.objects.get(name="doctor-node"))
    refused = doctor.node_credential()
    assert refused["verdict"] == "failed" and "node_revoked" in refused["found"], refused
    assert "nodes enrol --existing doctor-node" in refused["advice"]

    gone = Credential(server="http://127.0.0.1:9", node="doctor-node", credential="bnc_x")  # nothing listens on 9
    gone.save(settings.NODE_CREDENTIAL_FILE)
    assert doctor.node_credential()["verdict"] == "failed"
