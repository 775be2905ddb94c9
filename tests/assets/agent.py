"""A real node agent for tests: a Celery worker on the node's queue, against the test database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from django.db import connection

from tests.assets.database import database_environ
from tests.assets.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
# One name per test run: two runs sharing a Redis database never consume each other's node queue.
NODE = f"agent-test-node-{os.getpid()}"


class Agent:
    """``manage.py agent --node NODE`` as a subprocess on the test database (stopped by its PID)."""

    def __init__(self, tmp_path: Path, model_root: Path, slots: int = 1, log_name: str = "agent.log",
                 startup_timeout: int = 120, environ: dict | None = None):
        """``environ`` overrides any variable (another database: ``DATABASE_URL``)."""
        db = connection.settings_dict
        self.log_path = tmp_path / log_name
        environment = dict(os.environ, **database_environ(db),
                           BERTH_MODEL_ROOTS=str(model_root), BERTH_ENGINE_DIR=str(tmp_path / "engines"),
                           BERTH_STARTUP_SLOTS=str(slots), BERTH_HEARTBEAT_SECONDS="1",
                           BERTH_STARTUP_TIMEOUT_SECONDS=str(startup_timeout))
        environment.update(environ or {})
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, "manage.py", "agent", "--node", NODE, "--concurrency", "4"],
                                        cwd=ROOT, env=environment, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        wait_until(lambda: "ready." in self.log_path.read_text() or self._died(), 90, what="the agent worker ready")

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
