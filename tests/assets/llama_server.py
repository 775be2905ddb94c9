"""A real llama-server on a free loopback port, started for a test and stopped by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx

from tests.assets.waiting import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: Path, model: Path, log_path: Path, *, context: int = 512, parallel: int = 1,
                 threads: int = 2, api_key: str | None = None, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.parallel = parallel  # its slots, which a Deployment row of it records as its config's "parallel"
        self.log_path = log_path
        self.api_key = api_key
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(context), "--parallel", str(parallel), "-t", str(threads), "--metrics", *extra]
        env = dict(os.environ)
        if api_key:
            env["LLAMA_API_KEY"] = api_key  # through the environment, never on the command line
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {self.process.returncode}: {self.log_tail()}")
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 120) -> "LlamaServer":
        wait_until(self.healthy, timeout, what=f"llama-server /health on port {self.port}")
        return self

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
