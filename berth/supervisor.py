"""Run several programs as one group: they start together and stop together.

Each program runs in its own session, so a Ctrl-C in the terminal reaches only the supervisor,
which then stops every program in an orderly way (SIGTERM to its process group, SIGKILL after a
grace period). If one program exits on its own, the group is stopped too and the supervisor
exits with that program's status: a half-running Berth is worse than a stopped one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Sequence, TextIO


class Supervisor:
    def __init__(self, programs: Mapping[str, Sequence[str]], *, env: Mapping[str, str] | None = None,
                 grace: float = 20.0, out: TextIO | None = None):
        self.programs = dict(programs)
        self.env = dict(env) if env is not None else None
        self.grace = grace
        self.out = out or sys.stdout
        self.processes: dict[str, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._stop = threading.Event()
        self._print_lock = threading.Lock()
        self.stop_reason = ""

    def say(self, name: str, line: str) -> None:
        with self._print_lock:
            self.out.write(f"{name:>7} | {line.rstrip()}\n")
            self.out.flush()

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    def start(self) -> None:
        for name, argv in self.programs.items():
            process = subprocess.Popen(list(argv), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
            self.processes[name] = process
            pump = threading.Thread(target=self._pump, args=(name, process), daemon=True)
            pump.start()
            self._pumps.append(pump)
            self.say("berth", f"started {name} (pid {process.pid})")

    def _pump(self, name: str, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.say(name, line)

    def wait(self, on_tick: Callable[[], None] | None = None) -> int:
        """Block until a stop is requested or a program exits; then stop the group."""
        failed: tuple[str, int] | None = None
        while not self._stop.wait(0.25):
            for name, process in self.processes.items():
                code = process.poll()
                if code is not None:
                    failed = (name, code)
                    self.request_stop(f"{name} exited with status {code}")
                    break
            if on_tick and not self._stop.is_set():
                on_tick()
        self.say("berth", f"stopping: {self.stop_reason}")
        self.stop_all()
        if failed:
            return failed[1] or 1  # a program that exits on its own, even with 0, is a failure of the group
        return 0

    def stop_all(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is None:
                # The program itself first: Celery and uvicorn then stop their own children in order.
                _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say("berth", f"{name} did not stop within {self.grace:.0f}s: killing it")
                # Still unreaped, so its process group id cannot have been reused: safe to kill the group.
                _signal(process, signal.SIGKILL, group=True)
                process.wait()
        for pump in self._pumps:
            pump.join(timeout=5)  # the last lines a program printed come before "stopped"
        for name, process in self.processes.items():
            self.say("berth", f"{name} stopped (status {process.returncode})")

    def run(self, on_tick: Callable[[], None] | None = None) -> int:
        """Start, handle SIGINT/SIGTERM, and return the group's exit status."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda signum, frame: self.request_stop(signal.Signals(signum).name))
        try:
            self.start()
            return self.wait(on_tick)
        finally:
            if any(p.poll() is None for p in self.processes.values()):
                self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _signal(process: subprocess.Popen, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(process.pid, sig)  # the program's own session: its children go too
        else:
            process.send_signal(sig)
    except ProcessLookupError:
        pass
