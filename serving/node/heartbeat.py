"""The agent's beat: every few seconds it sends the node's report (telemetry, GPUs, engines
installed, weights held) and what it sees of its engines — each managed engine running here, and
each the control plane expects to run (its last answer) — to ``/api/node/heartbeat/``. An engine
that no longer runs is reported with how it ended and its log tail, read before it is cleaned up;
that report is sent again until a beat gets through, so a failure's evidence is never lost to a
control plane away for a while. The control plane does the rest (``serving.control.node_reports``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from django.conf import settings

from serving.node.client import NodeClient
from serving.node.discovery import local_node_report
from serving.node.lifecycle import stop_with_tail
from serving.node.runtime import managed, runtime_for
from serving.runtimes.base import EngineSeen, Handle

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, client: NodeClient, node_name: str, agent: str = ""):
        self.client = client
        self.node_name = node_name
        self.agent = agent  # this agent's instance: its first beat makes it the node's
        self.expected: dict[str, Handle] = {}
        self.pending: dict[str, EngineSeen] = {}  # ended engines not yet reported
        self.busy: set[str] = set()  # replicas a job here is working on: that job reports on them
        self.interval = settings.SERVING_HEARTBEAT_SECONDS
        self._lock = threading.Lock()

    def send(self, *, first: bool = False) -> dict:
        """One beat; ``first``: the agent has just started (the control plane adopts what it finds)."""
        with self._lock:
            report = dataclasses.replace(local_node_report(), name=self.node_name)
            seen = self._engines(first)
            answer = self.client.post("heartbeat/", {"report": dataclasses.asdict(report), "first": first,
                                                     "agent": self.agent,
                                                     "engines": [engine.as_wire() for engine in seen]}) or {}
            for engine in seen:
                self.pending.pop(engine.handle.replica_id, None)
            self.expected = {h["replica_id"]: Handle(**h) for h in answer.get("expected") or ()}
            return answer

    def _engines(self, first: bool) -> list[EngineSeen]:
        handles = {handle.replica_id: handle for handle in managed()}
        for replica_id, handle in self.expected.items():
            handles.setdefault(replica_id, handle)
        running = []
        for replica_id, handle in handles.items():
            if replica_id in self.pending or replica_id in self.busy:
                continue
            runtime = runtime_for(handle.runtime)
            status = runtime.status(handle)
            if status.running:
                named = served_name_and_port(handle) if first else {}
                running.append(EngineSeen(handle=handle, running=True, **named))
            else:
                tail, stopped = stop_with_tail(runtime, handle, grace_seconds=10)
                self.pending[replica_id] = EngineSeen(handle=handle, running=False, exit=status.exit or stopped,
                                                      log_tail=tail)
        return running + list(self.pending.values())

    def forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                self.send()
            except Exception as error:  # a failed beat is logged and retried; it must not end the thread
                log.warning("heartbeat not sent: %s", error)


def served_name_and_port(handle: Handle) -> dict:
    """What an engine serves and where, from its own command line (the only record left of one
    running without a record)."""
    argv: list[str] = []
    try:
        if handle.runtime == "process" and handle.pid:
            argv = open(f"/proc/{handle.pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        elif handle.runtime == "docker" and handle.container_id:
            argv = list(runtime_for("docker").client.containers.get(handle.container_id).attrs.get("Args") or [])
    except Exception as error:  # noqa: BLE001 - gone meanwhile, or the daemon away: nothing to read
        log.info("could not read what %s serves: %s", handle.replica_id, error)
        return {}

    def after(flag):
        return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else ""

    port = after("--port")
    return {"served_name": after("--alias") or after("--served-model-name"),
            "port": int(port) if port.isdigit() else None}
