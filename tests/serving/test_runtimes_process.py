"""The process runtime with a real llama-server on generated GGUF models.

Every engine is started on a free loopback port in the test's own engines directory and stopped by
its PID (the ``process_runtime`` fixture stops anything still running).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from serving.engines.base import EngineCommand
from serving.engines.llamacpp import LlamaCpp
from serving.runtimes import process as process_module
from serving.runtimes.base import Handle
from serving.runtimes.process import ProcessRuntime, kernel_oom_line, proc_start_time
from tests.assets.waiting import wait_until

pytestmark = pytest.mark.llama


@pytest.fixture
def engine(llama_server_binary):
    return LlamaCpp(binary=llama_server_binary)


def base_url(spec) -> str:
    return f"http://{spec.host}:{spec.port}"


def healthy(runtime, handle, spec) -> bool:
    status = runtime.status(handle)
    if not status.running:
        raise AssertionError(f"the engine ended ({status.exit.describe()}): {runtime.logs(handle, 20)}")
    try:
        return httpx.get(base_url(spec) + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_ready(runtime, engine, spec):
    handle = runtime.start(spec, engine.command(spec))
    wait_until(lambda: healthy(runtime, handle, spec), 120, what=f"llama-server /health on {spec.port}")
    return handle


def test_engine_starts_answers_the_probe_reports_peak_memory_and_stops(process_runtime, engine, launch_spec, gguf_model):
    spec = launch_spec(gguf_model())
    handle = start_ready(process_runtime, engine, spec)

    probe = engine.probe(spec, "completion")
    answer = httpx.post(base_url(spec) + probe.path, json=probe.body, timeout=30,
                        headers={"Authorization": f"Bearer {spec.api_key}"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 1
    unauthenticated = httpx.post(base_url(spec) + probe.path, json=probe.body, timeout=30)
    assert unauthenticated.status_code == 401  # the key reached the engine (through its environment)

    status = process_runtime.status(handle)
    assert status.running
    assert status.peak_memory_bytes and status.peak_memory_bytes > 1_000_000
    assert handle.pid_start_time == proc_start_time(handle.pid)
    cmdline = open(f"/proc/{handle.pid}/cmdline", "rb").read().split(b"\0")
    assert spec.api_key.encode() not in b" ".join(cmdline)

    exit = process_runtime.stop(handle, grace_seconds=20)

    assert exit is not None and not exit.out_of_memory
    assert not process_runtime.status(handle).running
    assert process_runtime.managed() == []
    # Remembered after the exit: the last reading while it ran (stop() reads once more, so it may be higher).
    assert process_runtime.status(handle).peak_memory_bytes >= status.peak_memory_bytes


def test_engine_environment_holds_its_key_but_none_of_berths_secrets(process_runtime, engine, launch_spec,
                                                                     gguf_model, monkeypatch):
    monkeypatch.setenv("BERTH_KEY_PEPPER", "pepper-that-must-not-leak")
    monkeypatch.setenv("BERTH_SECRET_KEY", "secret-that-must-not-leak")
    monkeypatch.setenv("DATABASE_URL", "postgres://berth:password@db/berth")
    spec = launch_spec(gguf_model())

    handle = process_runtime.start(spec, engine.command(spec))

    def environment():
        raw = open(f"/proc/{handle.pid}/environ", "rb").read().decode()
        return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)

    # /proc/<pid>/environ is the engine's once its exec is done
    environ = wait_until(lambda: (env := environment()) and "LLAMA_API_KEY" in env and env, 10,
                         what="the engine's environment")
    assert environ["LLAMA_API_KEY"] == spec.api_key
    assert not [name for name in environ if name.startswith("BERTH_")]
    assert "DATABASE_URL" not in environ and "REDIS_URL" not in environ
    assert "must-not-leak" not in repr(environ)
    process_runtime.stop(handle, grace_seconds=10)


def test_a_corrupt_model_ends_the_engine_and_its_log_says_why(process_runtime, engine, launch_spec, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 4096)  # the magic, then garbage
    spec = launch_spec(corrupt)

    handle = process_runtime.start(spec, engine.command(spec))
    status = wait_until(lambda: (s := process_runtime.status(handle)) and not s.running and s, 60,
                        what="the engine to exit")

    assert status.exit.signal is None and status.exit.code not in (None, 0)  # it ended by itself, failing
    assert not status.exit.out_of_memory
    log = process_runtime.logs(handle, lines=200)
    assert "failed to load model" in log
    assert str(corrupt) in log


def test_a_sigkill_is_reported_as_sigkill_never_as_out_of_memory(process_runtime, engine, launch_spec, gguf_model):
    spec = launch_spec(gguf_model())
    handle = start_ready(process_runtime, engine, spec)

    os.kill(handle.pid, signal.SIGKILL)
    status = wait_until(lambda: (s := process_runtime.status(handle)) and not s.running and s, 30,
                        what="the engine to die")

    assert status.exit.signal == signal.SIGKILL
    assert not status.exit.out_of_memory
    assert status.exit.describe() == "killed by SIGKILL"


def test_a_restarted_agent_adopts_the_running_engine_and_can_stop_it(tmp_path, engine, launch_spec, gguf_model):
    engines_dir = tmp_path / "engines"
    first = ProcessRuntime(engines_dir)
    spec = launch_spec(gguf_model())
    handle = start_ready(first, engine, spec)
    try:
        after_restart = ProcessRuntime(engines_dir)  # a new agent: it knows only the engines directory

        adopted = after_restart.managed()

        assert adopted == [Handle(runtime="process", replica_id=spec.replica_id, pid=handle.pid,
                                  pid_start_time=handle.pid_start_time, log_path=handle.log_path)]
        assert after_restart.status(adopted[0]).running
        assert "llama" in after_restart.logs(adopted[0], lines=50)
        exit = after_restart.stop(adopted[0], grace_seconds=20)
        assert exit is not None
        assert not first.status(handle).running
        assert after_restart.managed() == []
    finally:
        first.stop(handle, grace_seconds=5)


def test_a_reused_pid_is_not_taken_for_the_engine(process_runtime, tmp_path):
    engines_dir = process_runtime.state_dir
    engines_dir.mkdir(parents=True)
    # A pidfile naming this test's own PID with another start time: the PID was reused.
    (engines_dir / "r-stale.json").write_text(
        f'{{"replica_id": "r-stale", "pid": {os.getpid()}, "pid_start_time": {proc_start_time(os.getpid()) + 1}}}')
    handle = Handle(runtime="process", replica_id="r-stale", pid=os.getpid(),
                    pid_start_time=proc_start_time(os.getpid()) + 1)

    assert process_runtime.managed() == []
    status = process_runtime.status(handle)
    assert not status.running and status.exit.describe() == "vanished"
    assert process_runtime.stop(handle, grace_seconds=1) is None  # and it is never signalled


def test_an_engine_ignoring_sigterm_is_killed_after_the_grace_period(process_runtime, launch_spec, tmp_path):
    spec = launch_spec(tmp_path / "unused.gguf")
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(120)\n"
    handle = process_runtime.start(spec, EngineCommand(argv=(sys.executable, "-c", script), env={}))
    wait_until(lambda: "up" in process_runtime.logs(handle), 30, what="the process to start")

    exit = process_runtime.stop(handle, grace_seconds=0.5)

    assert exit.signal == signal.SIGKILL and not exit.out_of_memory


def test_an_exit_status_is_kept_for_a_later_runtime_instance(process_runtime, launch_spec, tmp_path):
    spec = launch_spec(tmp_path / "unused.gguf")
    handle = process_runtime.start(spec, EngineCommand(argv=(sys.executable, "-c", "raise SystemExit(3)"), env={}))
    first = wait_until(lambda: (s := process_runtime.status(handle)) and not s.running and s, 30,
                       what="the process to exit")
    assert first.exit.code == 3

    # A new agent process is no longer the parent: it reads the exit file the old one wrote.
    entry = process_module._children.pop(handle.pid)
    try:
        later = ProcessRuntime(process_runtime.state_dir).status(handle)
    finally:
        process_module._children[handle.pid] = entry
    assert not later.running and later.exit.code == 3


def test_an_engine_that_ended_with_no_agent_watching_has_vanished(process_runtime):
    outsider = subprocess.Popen([sys.executable, "-c", "pass"])
    start_time = proc_start_time(outsider.pid)
    outsider.wait()
    handle = Handle(runtime="process", replica_id="r-outsider", pid=outsider.pid, pid_start_time=start_time)

    status = process_runtime.status(handle)

    assert not status.running
    assert status.exit.code is None and status.exit.signal is None and status.exit.describe() == "vanished"


def test_oom_evidence_is_the_kernel_line_for_that_pid_after_it_started():
    records = [
        (10.0, "Out of memory: Killed process 4242 (llama-server) total-vm:912340kB, anon-rss:801234kB"),
        (50.0, "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),task=llama-server,pid=4343,uid=0"),
        (60.0, "Memory cgroup out of memory: Killed process 4343 (llama-server) total-vm:1kB"),
    ]

    assert kernel_oom_line(4242, not_before_s=5.0, records=records).startswith("Out of memory: Killed process 4242")
    assert kernel_oom_line(4242, not_before_s=20.0, records=records) is None  # an older process with that PID
    assert "pid=4343" in kernel_oom_line(4343, not_before_s=40.0, records=records)
    assert kernel_oom_line(4444, records=records) is None
    assert kernel_oom_line(4444, records=[]) is None  # an unreadable kernel log is no evidence
