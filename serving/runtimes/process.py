"""Engines as local processes: own session, log file, pidfile, adoption after an agent restart.

Each engine runs in its own session (and so its own process group), detached from the agent, so an
agent restart leaves it running. A pidfile ``<replica>.json`` in the engines directory records its
PID and start time (``/proc/<pid>/stat`` field 22, in clock ticks since boot): a PID alone would be
trusted even after the kernel gave it to another process.

Exit status is known only to the parent. While the agent that started an engine lives, it reaps it
and writes ``<replica>.exit`` so a restarted agent can still say how it ended; an engine that ends
while no agent is its parent is reported as vanished. Out of memory is claimed only with the kernel
OOM killer's own line for that PID; without it a SIGKILL is a SIGKILL.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from serving.engines.base import EngineCommand, LaunchSpec
from serving.errors import EngineAlreadyRunning, EngineStartFailed
from serving.runtimes.base import Exit, Handle, Status

# The environment an engine starts from: enough to run, nothing of the agent's (its database URL,
# secret key and key pepper must never reach a process that serves requests).
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH = ("HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME",
                  "LD_LIBRARY_PATH", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME")
_REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Popen objects of the engines this process started, kept for the life of the process: a Popen
# that is garbage-collected while its child runs is reaped by the subprocess module later, which
# would swallow the exit status we need. Shared by every ProcessRuntime in this process, because
# the parent is the process, not the object.
_children: dict[int, tuple[subprocess.Popen, int | None]] = {}  # pid → (Popen, start time)
_children_lock = threading.Lock()


def engine_environment(command_env: dict[str, str], parent: dict[str, str] | None = None) -> dict[str, str]:
    parent = os.environ if parent is None else parent
    env = {"PATH": SAFE_PATH}
    env.update({key: parent[key] for key in PASSED_THROUGH if key in parent})
    env.update(command_env)
    return env


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after the last ")".
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: not running
        return None
    return int(fields[19])  # fields[0] is field 3 (state)


def vm_hwm_bytes(pid: int) -> int | None:
    """Peak resident set size (VmHWM) of a running process."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _boot_seconds_of(ticks: int) -> float:
    return ticks / os.sysconf("SC_CLK_TCK")


_OOM_LINE = re.compile(r"(?:Killed process|oom-kill:.*?\bpid=)\s*(\d+)")


def kernel_oom_line(pid: int, not_before_s: float | None = None, records=None) -> str | None:
    """The kernel OOM killer's line for ``pid`` (logged after ``not_before_s`` seconds since boot,
    so a line for an older process with the same PID does not count). None when there is none or
    the kernel log cannot be read (a sandbox): no evidence, never a guess. ``records`` replaces the
    kernel log with (seconds since boot, message) pairs."""
    for timestamp, text in (_kernel_log() if records is None else records):
        if not_before_s is not None and timestamp is not None and timestamp < not_before_s:
            continue
        for match in _OOM_LINE.finditer(text):
            if int(match.group(1)) == pid and ("Out of memory" in text or "oom-kill" in text or "Killed process" in text):
                return text.strip()
    return None


def _kernel_log():
    """(seconds since boot, message) records of the kernel log, from /dev/kmsg (non-blocking)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while reading: skip the lost records
                    continue
                break  # EAGAIN: the end; EPERM/EINVAL: unreadable
            if not record:
                break
            prefix, _, message = record.decode(errors="replace").partition(";")
            parts = prefix.split(",")
            try:
                timestamp = int(parts[2]) / 1_000_000
            except (IndexError, ValueError):
                timestamp = None
            yield timestamp, message.split("\n", 1)[0]
    finally:
        os.close(fd)


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a (possibly large) log file."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            end = handle.tell()
            size, data = 8192, b""
            while True:
                start = max(0, end - size)
                handle.seek(start)
                data = handle.read(end - start)
                if start == 0 or data.count(b"\n") > lines:
                    break
                size *= 4
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


class ProcessRuntime:
    kind = "process"

    def __init__(self, state_dir: str | Path | None = None):
        if state_dir is None:
            from django.conf import settings

            state_dir = settings.SERVING_ENGINE_DIR
        self.state_dir = Path(state_dir)
        self._peaks: dict[str, int] = {}  # replica → last VmHWM read while it ran

    # -- files of a replica
    def _pidfile(self, replica_id: str) -> Path:
        return self.state_dir / f"{replica_id}.json"

    def _exitfile(self, replica_id: str) -> Path:
        return self.state_dir / f"{replica_id}.exit"

    def start(self, spec: LaunchSpec, command: EngineCommand) -> Handle:
        if not _REPLICA_ID.match(spec.replica_id):
            raise EngineStartFailed(f"Replica id {spec.replica_id!r} cannot name a file.",
                                    details={"replica_id": spec.replica_id})
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for handle in self._recorded(spec.replica_id):
            if self.status(handle).running:
                raise EngineAlreadyRunning(f"Replica {spec.replica_id} already runs as PID {handle.pid}.",
                                           details={"pid": handle.pid})
        log_path = Path(spec.log_path) if spec.log_path else self.state_dir / f"{spec.replica_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._exitfile(spec.replica_id).unlink(missing_ok=True)
        with open(log_path, "ab") as log:
            try:
                process = subprocess.Popen(
                    list(command.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=engine_environment(command.env), cwd=self.state_dir, start_new_session=True,
                    close_fds=True)
            except OSError as exc:
                raise EngineStartFailed(f"Cannot start {command.argv[0]}: {exc.strerror or exc}.",
                                        details={"argv0": command.argv[0]}) from exc
        start_time = proc_start_time(process.pid)
        with _children_lock:
            _children[process.pid] = (process, start_time)
        handle = Handle(runtime=self.kind, replica_id=spec.replica_id, pid=process.pid,
                        pid_start_time=start_time, log_path=str(log_path))
        record = {"runtime": self.kind, "replica_id": spec.replica_id, "pid": process.pid,
                  "pid_start_time": start_time, "log_path": str(log_path), "labels": dict(spec.labels),
                  "executable": Path(command.argv[0]).name, "started_at": time.time()}
        partial = self._pidfile(spec.replica_id).with_suffix(".json.part")
        partial.write_text(json.dumps(record))
        partial.rename(self._pidfile(spec.replica_id))  # a pidfile is whole or absent
        if start_time is None:  # it exited before we could read /proc: status() will say how
            self.status(handle)
        return handle

    def status(self, handle: Handle) -> Status:
        # /proc first: a process being killed is neither running nor reapable for an instant, and
        # asking waitpid first would take that instant for "still running".
        if handle.pid and handle.pid_start_time is not None and proc_start_time(handle.pid) == handle.pid_start_time:
            peak = vm_hwm_bytes(handle.pid)
            if peak is not None:
                self._peaks[handle.replica_id] = max(peak, self._peaks.get(handle.replica_id, 0))
            return Status(running=True, peak_memory_bytes=self._peaks.get(handle.replica_id))
        peak = self._peaks.get(handle.replica_id)
        child = self._child(handle)
        if child is not None:
            try:
                child.wait(timeout=5)  # a zombie by now (or reaped already): returns at once
            except subprocess.TimeoutExpired:
                return Status(running=True, peak_memory_bytes=peak)
            return Status(running=False, exit=self._exit_of_child(handle, child), peak_memory_bytes=peak)
        return Status(running=False, exit=self._recorded_exit(handle), peak_memory_bytes=peak)

    @staticmethod
    def _child(handle: Handle) -> subprocess.Popen | None:
        """Our Popen for this handle's process, if this process started it (same PID *and* start time)."""
        entry = _children.get(handle.pid) if handle.pid else None
        if entry is None or entry[1] != handle.pid_start_time:
            return None
        return entry[0]

    def _exit_of_child(self, handle: Handle, child: subprocess.Popen) -> Exit:
        code = child.returncode
        if code < 0:
            evidence = None
            if -code == signal.SIGKILL:
                since = _boot_seconds_of(handle.pid_start_time) if handle.pid_start_time else None
                evidence = kernel_oom_line(child.pid, since)
            exit = Exit(code=None, signal=-code, oom_evidence=evidence)
        else:
            exit = Exit(code=code, signal=None)
        exitfile = self._exitfile(handle.replica_id)
        if not exitfile.exists():
            exitfile.write_text(json.dumps({"pid": handle.pid, "pid_start_time": handle.pid_start_time,
                                            "code": exit.code, "signal": exit.signal,
                                            "oom_evidence": exit.oom_evidence}))
        return exit

    def _recorded_exit(self, handle: Handle) -> Exit:
        try:
            data = json.loads(self._exitfile(handle.replica_id).read_text())
        except (OSError, ValueError):
            return Exit(code=None, signal=None)  # vanished: it ended while no agent was its parent
        if data.get("pid") != handle.pid or data.get("pid_start_time") != handle.pid_start_time:
            return Exit(code=None, signal=None)
        return Exit(code=data.get("code"), signal=data.get("signal"), oom_evidence=data.get("oom_evidence"))

    def stop(self, handle: Handle, grace_seconds: float = 30) -> Exit | None:
        """SIGTERM to the engine's process group, SIGKILL after ``grace_seconds``. The exit, or None
        when it was not running."""
        was_running = self.status(handle).running
        if was_running:
            self._signal_group(handle, signal.SIGTERM)
            if not self._wait_gone(handle, grace_seconds):
                self._signal_group(handle, signal.SIGKILL)
                self._wait_gone(handle, 30)
        final = self.status(handle)
        self._pidfile(handle.replica_id).unlink(missing_ok=True)
        with _children_lock:
            child = self._child(handle)
            if child is not None and child.returncode is not None:
                del _children[handle.pid]
        if not was_running:
            return None
        # Asked to stop: a SIGKILL we sent ourselves after the grace period is not the kernel's OOM.
        return final.exit

    def _signal_group(self, handle: Handle, signum: int) -> None:
        if handle.pid is None or proc_start_time(handle.pid) != handle.pid_start_time:
            return  # never signal a PID that now belongs to someone else
        try:
            os.killpg(handle.pid, signum)  # its own session: the PID is the group id
        except ProcessLookupError:
            pass

    def _wait_gone(self, handle: Handle, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.status(handle).running:
                return True
            time.sleep(0.05)
        return not self.status(handle).running

    def logs(self, handle: Handle, lines: int = 200) -> str:
        path = Path(handle.log_path) if handle.log_path else self.state_dir / f"{handle.replica_id}.log"
        return tail(path, lines)

    def _recorded(self, replica_id: str | None = None) -> list[Handle]:
        pattern = f"{replica_id}.json" if replica_id else "*.json"
        handles = []
        for pidfile in sorted(self.state_dir.glob(pattern)):
            try:
                data = json.loads(pidfile.read_text())
                handles.append(Handle(runtime=self.kind, replica_id=data["replica_id"], pid=int(data["pid"]),
                                      pid_start_time=data.get("pid_start_time"), log_path=data.get("log_path")))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return handles

    def managed(self) -> list[Handle]:
        """Engines started by Berth (a pidfile here) whose PID still runs with the recorded start time."""
        if not self.state_dir.is_dir():
            return []
        return [handle for handle in self._recorded()
                if handle.pid_start_time is not None and proc_start_time(handle.pid) == handle.pid_start_time]
