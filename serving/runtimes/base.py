"""What every runtime provides: start a command, report on it, stop it, find it again.

Runtimes are the only code that touches processes and containers. Engines they start outlive the
agent: after a restart ``managed()`` lists what is still running so it can be adopted.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from serving.engines.base import EngineCommand, LaunchSpec


@dataclasses.dataclass(frozen=True)
class Handle:
    """How to find a running engine again; stored on the replica row."""

    runtime: str  # "process" | "docker"
    replica_id: str
    pid: int | None = None
    pid_start_time: int | None = None  # /proc/<pid>/stat field 22: guards against PID reuse
    container_id: str | None = None
    log_path: str | None = None


@dataclasses.dataclass(frozen=True)
class Exit:
    """Why an engine is no longer running. ``oom_evidence`` is set only when there is proof
    (Docker's OOMKilled, the kernel OOM killer's line); a bare SIGKILL/137 is not proof."""

    code: int | None  # exit status, when known
    signal: int | None  # the signal that ended it, when known
    oom_evidence: str | None = None

    @property
    def out_of_memory(self) -> bool:
        return self.oom_evidence is not None

    def describe(self) -> str:
        if self.oom_evidence:
            return f"out of memory ({self.oom_evidence})"
        if self.signal:
            import signal as signals

            try:
                return f"killed by {signals.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exited with status {self.code}" if self.code is not None else "vanished"


@dataclasses.dataclass(frozen=True)
class Status:
    running: bool
    exit: Exit | None = None  # set when not running
    peak_memory_bytes: int | None = None  # peak resident memory (VmHWM / cgroup peak), when measured


@dataclasses.dataclass(frozen=True)
class EngineSeen:
    """What a node saw of one managed engine, as its agent reports it to the control plane: the
    engine's handle, whether it runs, and once it no longer does, how it ended and its log tail. At
    an agent's start-up, an engine running without a record says what it serves and where."""

    handle: Handle
    running: bool
    exit: Exit | None = None
    log_tail: str = ""
    served_name: str = ""
    port: int | None = None

    def as_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> EngineSeen:
        """From a report's JSON; ``KeyError``/``TypeError`` on a malformed one (the caller says 400)."""
        exit = data.get("exit")
        return cls(handle=Handle(**data["handle"]), running=bool(data["running"]),
                   exit=Exit(**exit) if exit else None, log_tail=str(data.get("log_tail") or "")[-20000:],
                   served_name=str(data.get("served_name") or ""),
                   port=int(data["port"]) if data.get("port") is not None else None)


class Runtime(Protocol):
    kind: str

    def start(self, spec: LaunchSpec, command: EngineCommand) -> Handle: ...

    def status(self, handle: Handle) -> Status: ...

    def stop(self, handle: Handle, grace_seconds: float = 30) -> Exit | None: ...

    def logs(self, handle: Handle, lines: int = 200) -> str: ...

    def managed(self) -> list[Handle]:
        """Every engine this runtime runs for Berth on this node (for adoption after a restart)."""
