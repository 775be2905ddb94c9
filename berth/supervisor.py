"""Run several programs as one group and keep every one of them running.

Each program runs in its own session, so a Ctrl-C in the terminal reaches only the supervisor,
which then stops every program in an orderly way (SIGTERM to each, SIGKILL to its process group
after a grace period) and returns.

A program that exits on its own is started again, and only it: the others never notice. The
supervisor says why it ended (its status or the signal that killed it, and the last lines it
printed) and waits before starting it again: 1 s at first, doubling up to 30 s while the program
keeps exiting soon after it starts, back to 1 s once a run has lasted a minute. A program that
exits five times in a row that way is said, plainly, to keep exiting, and is still tried again:
what makes a program fail at start (the database or the broker away) usually ends, and Berth should
come back when it does, without anyone at the terminal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

TAIL_LINES = 3  # of what a program printed last, said with the reason it ended


@dataclass
class _Program:
    """One program of the group and where it stands: running (``restart_at`` None) or waiting."""

    name: str
    argv: list[str]
    delay: float  # the wait before the next start, should this run end soon
    process: subprocess.Popen | None = None
    pump: threading.Thread | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    started_at: float = 0.0
    starts: int = 0
    quick_exits: int = 0  # in a row, each before the run counted as steady
    restart_at: float | None = None  # the clock time it is to be started again


class Supervisor:
    """Start the programs, keep each running (restarting it with backoff), stop them all on request.

    ``clock`` and ``interval`` are what a test drives: ``step()`` is one pass of the loop that
    ``wait()`` runs every ``interval`` seconds, and every delay is measured on ``clock``.
    """

    def __init__(self, programs: Mapping[str, Sequence[str]], *, env: Mapping[str, str] | None = None,
                 grace: float = 20.0, out: TextIO | None = None, first_delay: float = 1.0,
                 longest_delay: float = 30.0, steady_after: float = 60.0, keeps_exiting_after: int = 5,
                 interval: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self._programs = {name: _Program(name, list(argv), delay=first_delay) for name, argv in programs.items()}
        self.env = dict(env) if env is not None else None
        self.grace = grace
        self.out = out or sys.stdout
        self.first_delay = first_delay
        self.longest_delay = longest_delay
        self.steady_after = steady_after
        self.keeps_exiting_after = keeps_exiting_after
        self.interval = interval
        self.clock = clock
        self._stop = threading.Event()
        self._print_lock = threading.Lock()
        self.stop_reason = ""

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """The latest process of each program that has been started."""
        return {name: program.process for name, program in self._programs.items() if program.process is not None}

    def say(self, name: str, line: str) -> None:
        self.write(f"{name:>7} | {line.rstrip()}\n")

    def write(self, text: str) -> None:
        """Text of the supervisor's caller, never cut into by a program's lines."""
        with self._print_lock:
            self.out.write(text)
            self.out.flush()

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    def start(self) -> None:
        for program in self._programs.values():
            self._start(program)

    def _start(self, program: _Program) -> None:
        program.restart_at = None
        program.tail = deque(maxlen=TAIL_LINES)  # this run's own: an old pump may still be finishing
        program.started_at = self.clock()
        try:
            process = subprocess.Popen(program.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        except OSError as exc:
            program.process = None
            self._ended(program, f"cannot be started: {exc.strerror or exc}")
            return
        program.process = process
        program.starts += 1
        program.pump = threading.Thread(target=self._pump, args=(program.name, process, program.tail), daemon=True)
        program.pump.start()
        again = f", restart {program.starts - 1}" if program.starts > 1 else ""
        self.say("berth", f"started {program.name} (pid {process.pid}{again})")

    def _pump(self, name: str, process: subprocess.Popen, tail: deque) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self._print_lock:
                tail.append(line.strip()[:200])
            self.say(name, line)

    def step(self) -> None:
        """One look at every program: note each that exited, start each whose wait is over."""
        for program in self._programs.values():
            if self._stop.is_set():
                return
            if program.restart_at is None:
                code = program.process.poll() if program.process is not None else None
                if code is not None:
                    self._ended(program, _how_it_ended(code))
            elif self.clock() >= program.restart_at:
                self._start(program)

    def _ended(self, program: _Program, how: str) -> None:
        now = self.clock()
        if program.process is not None:
            # What the program left in its own process group (a Celery pool whose master died) goes
            # too, before another copy starts. Just reaped, its PID cannot have been handed to a new
            # process group yet; engines the agent started run in sessions of their own and stay.
            _kill_group(program.process.pid)
            if program.pump is not None:
                program.pump.join(timeout=1)  # its last lines are part of why it ended
        if now - program.started_at >= self.steady_after:
            program.delay, program.quick_exits = self.first_delay, 0
        else:
            program.quick_exits += 1
        wait = program.delay
        program.delay = min(self.longest_delay, program.delay * 2)
        program.restart_at = now + wait
        with self._print_lock:
            tail = " / ".join(program.tail)
        reason = f"{how}; last output: {tail}" if tail else f"{how}; it printed nothing"
        if program.quick_exits >= self.keeps_exiting_after:
            self.say("berth", f"{program.name} keeps exiting: {reason} ({program.quick_exits} times in a row, each "
                              f"within {self.steady_after:g}s of its start); starting it again in {wait:g}s")
        else:
            self.say("berth", f"{program.name} exited: {reason}; starting it again in {wait:g}s")

    def wait(self, on_tick: Callable[[], None] | None = None) -> None:
        """Keep every program running until a stop is requested, then stop them all.

        ``on_tick`` runs every ``interval`` in a thread of its own, so a check that hangs (a
        database that accepts connections and answers nothing) never holds up a restart, and one
        that fails is said once until it works again: it never stops the group.
        """
        if on_tick is not None:
            threading.Thread(target=self._tick, args=(on_tick,), daemon=True, name="supervisor-tick").start()
        while not self._stop.wait(self.interval):
            self.step()
        self.say("berth", f"stopping: {self.stop_reason}")
        self.stop_all()

    def _tick(self, on_tick: Callable[[], None]) -> None:
        failing = False
        while not self._stop.wait(self.interval):
            try:
                on_tick()
            except Exception as exc:  # noqa: BLE001 - whatever a periodic check raises, the programs run on
                if not failing:
                    self.say("berth", f"a periodic check failed (retrying; every program keeps running): "
                                      f"{type(exc).__name__}: {exc}")
                failing = True
            else:
                if failing:
                    self.say("berth", "the periodic check works again")
                failing = False

    def stop_all(self) -> None:
        """SIGTERM to every running program, SIGKILL to the group of each still there after the grace."""
        live = [program for program in self._programs.values()
                if program.restart_at is None and program.process is not None]
        for program in live:
            if program.process.poll() is None:
                # The program itself first: Celery and uvicorn then stop their own children in order.
                _signal(program.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for program in live:
            try:
                program.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say("berth", f"{program.name} did not stop within {self.grace:.0f}s: killing it")
                # Still unreaped, so its process group id cannot have been reused: safe to kill the group.
                _signal(program.process, signal.SIGKILL, group=True)
                program.process.wait()
        for program in live:
            if program.pump is not None:
                program.pump.join(timeout=5)  # the last lines a program printed come before "stopped"
        for program in self._programs.values():
            if program in live:
                self.say("berth", f"{program.name} stopped (status {program.process.returncode})")
            else:
                program.restart_at = None
                self.say("berth", f"{program.name} was not running (it was waiting to be started again)")

    def run(self, on_tick: Callable[[], None] | None = None) -> None:
        """Start, keep running until SIGINT/SIGTERM, then stop everything and return."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda signum, frame: self.request_stop(signal.Signals(signum).name))
        try:
            self.start()
            self.wait(on_tick)
        finally:
            if any(p.poll() is None for p in self.processes.values()):
                self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(process: subprocess.Popen, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(process.pid, sig)  # the program's own session: its children go too
        else:
            process.send_signal(sig)
    except ProcessLookupError:
        pass
