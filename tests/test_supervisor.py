"""The supervisor behind `manage.py serve`: a program that exits is started again with backoff,
alone, with the reason said; the others never notice; a failing periodic check stops nothing.

Delays are measured on a clock the test moves: the only real waits are the programs' own starts.
"""

import io
import re
import sys
import threading

from berth.supervisor import Supervisor
from tests.assets.waiting import wait_until

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
CRASHER = [sys.executable, "-c", ("import sys; print('opening the database', flush=True); "
                                  "print('boom', flush=True); sys.exit(3)")]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _supervisor(clock, **programs):
    out = io.StringIO()
    return Supervisor(programs, grace=5, out=out, clock=clock), out


def _starts(out, name) -> list[int]:
    return [int(pid) for pid in re.findall(rf"started {name} \(pid (\d+)", out.getvalue())]


def _waits(out, name) -> list[float]:
    return [float(s) for s in re.findall(rf"{name} (?:exited|keeps exiting): .*; starting it again in ([\d.]+)s",
                                         out.getvalue())]


def _next_exit(supervisor, out, name) -> float:
    """Step the supervisor (on the real clock only as long as the program takes to exit) until it
    has noticed the program's next exit; the wait it chose."""
    seen = len(_waits(out, name))
    wait_until(lambda: supervisor.step() or len(_waits(out, name)) > seen, 30, what=f"{name} exiting")
    return _waits(out, name)[-1]


def test_a_program_that_exits_at_once_is_restarted_with_growing_delays_and_the_others_run_on():
    clock = Clock()
    supervisor, out = _supervisor(clock, sleeper=SLEEPER, crasher=CRASHER)
    supervisor.start()
    try:
        sleeper_pid = supervisor.processes["sleeper"].pid
        waits = []
        for restart in range(1, 8):
            wait = _next_exit(supervisor, out, "crasher")
            waits.append(wait)
            clock.advance(wait - 0.5)
            supervisor.step()
            assert len(_starts(out, "crasher")) == restart, "started again before its delay was over"
            clock.advance(0.5)
            supervisor.step()
            assert len(_starts(out, "crasher")) == restart + 1
        assert waits == [1, 2, 4, 8, 16, 30, 30]
        text = out.getvalue()
        assert "crasher exited: status 3; last output: opening the database / boom; starting it again in 1s" in text
        # From the fifth exit in a row it says plainly that this program keeps failing, and still retries it.
        assert text.count("crasher keeps exiting: status 3; last output: opening the database / boom (") == 3
        assert "crasher keeps exiting: status 3; last output: opening the database / boom (5 times in a row, " \
               "each within 60s of its start); starting it again in 16s" in text
        assert "crasher exited" not in text.split("(5 times in a row")[1]
        # The other program never noticed.
        assert supervisor.processes["sleeper"].pid == sleeper_pid and supervisor.processes["sleeper"].poll() is None
        assert _starts(out, "sleeper") == [sleeper_pid]
    finally:
        supervisor.request_stop("test")
        supervisor.wait()
    assert all(process.poll() is not None for process in supervisor.processes.values())


def test_the_delay_goes_back_to_one_second_once_a_run_has_lasted_a_minute():
    clock = Clock()
    supervisor, out = _supervisor(clock, crasher=CRASHER)
    supervisor.start()
    try:
        for expected in (1, 2, 4):
            assert _next_exit(supervisor, out, "crasher") == expected
            clock.advance(expected)
            supervisor.step()
        clock.advance(61)  # this run lasts a minute on the supervisor's clock before its exit is seen
        assert _next_exit(supervisor, out, "crasher") == 1
        clock.advance(1)
        supervisor.step()
        assert _next_exit(supervisor, out, "crasher") == 2
    finally:
        supervisor.request_stop("test")
        supervisor.wait()
    assert "crasher was not running (it was waiting to be started again)" in out.getvalue()


def test_a_killed_program_is_named_with_its_signal_and_restarted_alone():
    clock = Clock()
    supervisor, out = _supervisor(clock, sleeper=SLEEPER, victim=SLEEPER)
    supervisor.start()
    try:
        wait_until(lambda: out.getvalue().count("| up") == 2, 30, what="both programs up")
        sleeper_pid, victim_pid = supervisor.processes["sleeper"].pid, supervisor.processes["victim"].pid
        supervisor.processes["victim"].kill()
        assert _next_exit(supervisor, out, "victim") == 1
        assert "victim exited: killed by SIGKILL; last output: up; starting it again in 1s" in out.getvalue()
        clock.advance(1)
        supervisor.step()
        assert _starts(out, "victim") == [victim_pid, supervisor.processes["victim"].pid]
        assert f"started victim (pid {supervisor.processes['victim'].pid}, restart 1)" in out.getvalue()
        assert supervisor.processes["sleeper"].pid == sleeper_pid and supervisor.processes["sleeper"].poll() is None
    finally:
        supervisor.request_stop("test")
        supervisor.wait()
    assert all(process.poll() is not None for process in supervisor.processes.values())


def test_a_program_that_cannot_be_started_is_retried_with_the_reason():
    clock = Clock()
    supervisor, out = _supervisor(clock, missing=["/nonexistent/berth-program"])
    supervisor.start()
    assert "missing exited: cannot be started: No such file or directory; it printed nothing; " \
           "starting it again in 1s" in out.getvalue()
    clock.advance(1)
    supervisor.step()
    assert _waits(out, "missing") == [1, 2]
    supervisor.request_stop("test")
    supervisor.wait()


def test_a_periodic_check_that_fails_is_said_once_and_stops_nothing():
    calls = {"n": 0}

    def tick():
        calls["n"] += 1
        if calls["n"] <= 3:
            raise ConnectionError("the database is away")

    supervisor = Supervisor({"sleeper": SLEEPER}, grace=5, out=io.StringIO(), interval=0.05)
    out = supervisor.out
    supervisor.start()
    loop = threading.Thread(target=supervisor.wait, args=(tick,))
    loop.start()
    try:
        wait_until(lambda: "the periodic check works again" in out.getvalue(), 30, what="the check recovering")
        text = out.getvalue()
        assert text.count("a periodic check failed") == 1, text
        assert "ConnectionError: the database is away" in text
        assert supervisor.processes["sleeper"].poll() is None
        assert _starts(out, "sleeper") == [supervisor.processes["sleeper"].pid]
    finally:
        supervisor.request_stop("test")
        loop.join(timeout=30)
    assert not loop.is_alive()
    assert supervisor.processes["sleeper"].poll() is not None
