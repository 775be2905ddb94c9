"""A real node agent for tests: ``manage.py agent`` in a process of its own that holds no database,
broker or cluster secret — only the test server's URL and this node's credential."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

from django.conf import settings

from serving.node.client import CLUSTER_SETTINGS, Credential
from tests.assets.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
# One name per test run: two runs sharing a database never claim each other's node jobs.
NODE = f"agent-test-node-{os.getpid()}"


def issue_credential(path: Path, server: str, name: str = NODE) -> Credential:
    """A credential for node ``name`` (registered if new), written where an agent reads it."""
    from scheduler import enrolment
    from tenancy.audit import Actor

    credential = Credential(server=server.rstrip("/"), node=name, credential=enrolment.issue_credential(
        Actor(system="tests"), name, address="127.0.0.1"))
    credential.save(path)
    return credential


class Agent:
    """``manage.py agent`` as a subprocess talking to ``server`` (stopped by its PID).

    The start-up slots and the start-up timeout are the control plane's settings: set here in the
    test's process (the server's), and put back by ``stop``."""

    def __init__(self, tmp_path: Path, model_root: Path, server: str, slots: int = 1, log_name: str = "agent.log",
                 startup_timeout: int = 120, environ: dict | None = None, name: str = NODE,
                 credential: Credential | None = None):
        """``credential``: one issued before (kept across a restore), used with ``server``; else a new one."""
        self._settings = {key: getattr(settings, key) for key in ("SERVING_STARTUP_SLOTS",
                                                                  "SERVING_STARTUP_TIMEOUT_SECONDS")}
        settings.SERVING_STARTUP_SLOTS, settings.SERVING_STARTUP_TIMEOUT_SECONDS = slots, startup_timeout
        self.credential_path = tmp_path / f"{name}.credential"
        if credential is not None:
            self.credential = dataclasses.replace(credential, server=server.rstrip("/"))
            self.credential.save(self.credential_path)
        else:
            self.credential = issue_credential(self.credential_path, server, name)
        self.log_path = tmp_path / log_name
        environment = {key: value for key, value in os.environ.items() if key not in CLUSTER_SETTINGS}
        environment.update(BERTH_DATA_DIR=str(tmp_path / "agent-data"), BERTH_MODEL_ROOTS=str(model_root),
                           BERTH_ENGINE_DIR=str(tmp_path / "engines"), BERTH_HEARTBEAT_SECONDS="1")
        environment.update(environ or {})
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, "manage.py", "agent", "--credential-file",
                                         str(self.credential_path), "--concurrency", "4"],
                                        cwd=ROOT, env=environment, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        wait_until(lambda: " ready: " in self.log_path.read_text() or self._died(), 90, what="the agent ready")

    def _died(self):
        if self.process.poll() is not None:
            raise RuntimeError(f"agent exited: {self.log_path.read_text()[-3000:]}")
        return False

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        for key, value in self._settings.items():
            setattr(settings, key, value)
