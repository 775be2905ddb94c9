"""A private redis-server for fault tests: its own loopback port, nothing kept on disk, stopped by its
PID. Never the shared Redis: pause this one (SIGSTOP) to stall it, flush or restart it to lose
everything it held.

    with RedisServer() as server:          # or server = RedisServer() ... server.stop()
        process_under_test(environ={"REDIS_URL": server.url})
        server.pause(); ...; server.resume()
        server.restart()                   # same port, empty
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import redis

from tests.assets.llama_server import free_port
from tests.assets.waiting import wait_until


class RedisServer:
    def __init__(self, log_path: Path | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_path
        self.paused = False
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=log, stderr=subprocess.STDOUT)
        finally:
            if self.log_path:
                log.close()
        wait_until(self._answers, 20, interval=0.05, what=f"the private redis-server answering on {self.port}")

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.process.returncode}")
        client = self.client(socket_timeout=0.5)
        try:
            return client.ping()
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self, **options) -> redis.Redis:
        return redis.Redis.from_url(self.url, **options)

    def flush(self) -> None:
        client = self.client(socket_timeout=5)
        try:
            client.flushall()
        finally:
            client.close()

    def pause(self) -> None:
        """Stall it: connections are accepted (the kernel's backlog) but nothing is answered."""
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.kill(self.process.pid, signal.SIGCONT)
            self.paused = False

    def restart(self) -> None:
        """Stop it and start it again on the same port, holding nothing (as a Redis that keeps nothing on disk)."""
        self._stop_process()
        self.start()

    def _stop_process(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        self._stop_process()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
