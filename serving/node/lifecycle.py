"""An engine's life on its node, the agent's half: what a job asks, done here, reported back.

The control plane decides and records (``serving.control.node_work``): which engine starts when,
the start-up gate, memory, every state change. The agent does what only the node can — fetch the
weights it lacks, launch the engine, watch it load, stop it, put it to sleep and wake it — and says
what happened: the handle it launched, the load's peak memory and GPU readings, a failure's exit
and log tail. ``serving.node.agent`` claims the jobs and runs these.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import httpx

from berth.errors import BerthError
from scheduler.nvml import DeviceMemory, discover_gpus
from serving.engines import vllm
from serving.engines.base import LaunchSpec
from serving.engines.registry import engine_for
from serving.node import weights
from serving.node.discovery import agent_nvml, device_memory, meminfo
from serving.node.runtime import runtime_for
from serving.runtimes.base import Exit, Handle

log = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # readiness polling: an engine answering /health is noticed within 50 ms
TAIL_LINES = 200


class Job:
    """One leased job, as the agent works on it: its payload, and the calls that report on it."""

    def __init__(self, client, data: dict):
        self.client = client
        self.id = data["id"]
        self.kind = data["kind"]
        self.payload = data.get("payload") or {}
        self.lease = data["lease"]
        self.lost = False  # the lease was lost (expired, or the job was taken back): stop working on it

    def report(self, event: str, data: dict | None = None) -> dict:
        return self.client.post(f"jobs/{self.id}/report/", {"lease": self.lease, "event": event,
                                                             "data": data or {}}) or {}

    def complete(self, result: dict | None = None) -> dict:
        log.info("%s: %s", self, (result or {}).get("outcome") or "done")
        return self.client.post(f"jobs/{self.id}/complete/", {"lease": self.lease, "result": result or {}}) or {}

    def fail(self, error: str, details: dict | None = None) -> dict:
        log.warning("%s failed: %s", self, error[:500])
        return self.client.post(f"jobs/{self.id}/fail/", {"lease": self.lease, "error": error[:2000],
                                                           "details": details or {}}) or {}

    def __str__(self) -> str:
        return f"{self.kind} job {self.id}"


def run(job: Job, node_name: str) -> None:
    """Do what ``job`` asks."""
    {"start": start, "watch": watch, "stop": stop, "sleep": sleep, "wake": wake}[job.kind](job, node_name)


def start(job: Job, node_name: str) -> None:
    """The weights the node lacks first, before a start-up slot is taken (a long transfer must not
    hold the node's other starts back); then the turn at the gate; then the launch and the watch. A
    start that needs no weights was admitted at its claim: its launch came with it."""
    if job.payload.get("launch"):
        _launch_and_watch(job, job.payload["launch"])
        return
    try:
        for move in job.payload.get("transfers") or ():
            weights.fetch(job, move, job.payload.get("freeable") or ())
    except BerthError as error:
        job.fail(f"weights not on {node_name}: {error.message}")
        return
    admitted = job.report("admit")
    if not admitted.get("admitted"):
        job.complete({"outcome": "queued"})  # it waits its turn (or failed at it): the control plane says which
        return
    _launch_and_watch(job, admitted)


def watch(job: Job, node_name: str) -> None:
    """An engine an earlier agent launched, still loading: watched again from here."""
    _watch(job, job.payload, Handle(**job.payload["handle"]), before=None)


def _spec(launch: dict) -> LaunchSpec:
    spec = dict(launch["spec"])
    spec["gpu_uuids"] = tuple(spec.get("gpu_uuids") or ())
    return LaunchSpec(**spec)


def _launch_and_watch(job: Job, launch: dict) -> None:
    spec = _spec(launch)
    runtime = runtime_for(launch["runtime"])
    before = device_memory(spec.gpu_uuids) if spec.gpu_uuids else None  # the device delta's "before"
    try:
        handle = runtime.start(spec, engine_for(spec.engine).command(spec))
    except BerthError as error:
        job.fail(f"could not start: {error.message}", {"launch_failure": "crash"})
        return
    except Exception as error:  # the runtime's own failure (docker daemon gone, exec error)
        log.exception("starting %s failed", spec.replica_id)
        job.fail(f"could not start: {error}", {"launch_failure": "crash"})
        return
    launched = time.monotonic()
    if not job.report("launched", {"handle": dataclasses.asdict(handle)}).get("go"):
        runtime.stop(handle, grace_seconds=5)  # stopped while starting: do not leave it running
        job.complete({"outcome": "stopped"})
        return
    _watch(job, launch, handle, before=before, launched=launched)


def _watch(job: Job, launch: dict, handle: Handle, *, before: dict[str, DeviceMemory] | None,
           launched: float | None = None) -> None:
    """Loading → ready once /health answers 200 and one real request succeeds; failed when the
    engine exits, memory runs short, or the start-up timeout passes. Once ready, what the load took
    is measured (``before``: the GPUs as read before the engine started; an adopted engine has none),
    and how long (``launched``: this clock's reading once the runtime had started it; the control
    plane's clock is not this one, and its reports' round trips are no part of the engine's load)."""
    spec = _spec(launch)
    runtime, engine = runtime_for(handle.runtime), engine_for(spec.engine)
    base = f"http://{spec.host}:{spec.port}"
    headers = {"Authorization": f"Bearer {spec.api_key}"}
    timeout = launch["startup_timeout_seconds"]
    deadline = time.monotonic() + timeout
    margin = launch.get("margin_bytes") or 0
    every = launch.get("watching_every_seconds") or 1.0
    asked = time.monotonic()
    with httpx.Client(timeout=10) as http:
        while True:
            if job.lost:
                return  # the control plane took the job back; whoever holds it now decides
            if time.monotonic() - asked >= every:
                asked = time.monotonic()
                if not job.report("watching").get("go"):
                    job.complete({"outcome": "left"})  # stopped (or failed) by someone else meanwhile
                    return
            status = runtime.status(handle)
            if not status.running:
                _fail_engine(job, runtime, handle, f"engine {status.exit.describe() if status.exit else 'vanished'} "
                             "while loading", status.exit, launch_failure="crash")
                return
            available = meminfo().get("MemAvailable")  # this machine's figure: the engine runs here
            if available is not None and margin and available < margin and not spec.gpu_uuids:
                _fail_engine(job, runtime, handle, f"available memory fell to {available / 2**30:.1f} GiB, below the "
                             "safety margin, during start-up")
                return
            if _ready(http, base, headers, engine, spec, launch.get("task") or "chat"):
                peak = runtime.status(handle).peak_memory_bytes
                job.complete({"outcome": "ready", "peak_memory_bytes": peak,
                              "load_seconds": None if launched is None else time.monotonic() - launched,
                              "gpu": _gpu_readings(spec, handle, before) if spec.gpu_uuids else None})
                return
            if time.monotonic() > deadline:
                _fail_engine(job, runtime, handle, f"not ready within {timeout}s", launch_failure="hang")
                return
            time.sleep(POLL_SECONDS)


def _fail_engine(job: Job, runtime, handle: Handle, message: str, exit: Exit | None = None, *,
                 launch_failure: str = "") -> None:
    """The engine failed: its log tail read, the engine removed, and both reported with the reason."""
    tail, stopped = stop_with_tail(runtime, handle, grace_seconds=10)
    exit = exit or stopped
    job.fail(message, {"log_tail": tail, "exit": dataclasses.asdict(exit) if exit else None,
                       "launch_failure": launch_failure})


def stop_with_tail(runtime, handle: Handle, *, grace_seconds: float = 30) -> tuple[str, Exit | None]:
    """Read an engine's log tail, then stop it (or clean up after it, when it ended)."""
    tail, exit = "", None
    try:
        tail = runtime.logs(handle, lines=TAIL_LINES)
        exit = runtime.stop(handle, grace_seconds=grace_seconds)
    except Exception as error:  # keep reporting even if the runtime misbehaves
        log.warning("cleaning up %s: %s", handle.replica_id, error)
    return tail, exit


def _gpu_readings(spec: LaunchSpec, handle: Handle, before: dict[str, DeviceMemory] | None) -> dict:
    """What the control plane measures the load's device memory from: the engine's processes and the
    GPUs' readings before and after."""
    return {"pids": sorted(engine_pids(handle)), "before": _wire(before), "after": _wire(device_memory(spec.gpu_uuids))}


def _wire(readings: dict[str, DeviceMemory] | None) -> dict | None:
    if readings is None:
        return None
    return {uuid: {"used_bytes": reading.used_bytes,
                   "processes": None if reading.processes is None else {str(pid): used for pid, used in
                                                                        reading.processes.items()}}
            for uuid, reading in readings.items()}


def engine_pids(handle: Handle) -> set[int]:
    """The engine's processes on this machine: its own and its session's (vLLM loads the model in
    child processes, one per GPU with tensor parallelism; the process runtime gives each engine a
    session of its own). An engine in a container has no PID here: none."""
    if handle.pid is None:
        return set()
    pids = {handle.pid}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 3 and fields[3] == str(handle.pid):  # field 6 of stat: the session id
            pids.add(int(stat.parent.name))
    return pids


def _ready(http, base, headers, engine, spec, task) -> bool:
    try:
        if http.get(base + engine.health_path(), headers=headers, timeout=2).status_code != 200:
            return False
        probe = engine.probe(spec, task)
        return http.post(base + probe.path, json=probe.body, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def stop(job: Job, node_name: str) -> None:
    """Stop the engine (the control plane held the job back while its requests drained); with its
    log tail when it is stopped for a failure."""
    handle = Handle(**job.payload["handle"])
    runtime = runtime_for(handle.runtime)
    failing = (job.payload.get("then") or {}).get("state") == "failed"
    if failing:
        tail, exit = stop_with_tail(runtime, handle, grace_seconds=10)
    else:
        tail, exit = "", runtime.stop(handle)
    job.complete({"exit": dataclasses.asdict(exit) if exit else None, "log_tail": tail})


def sleep(job: Job, node_name: str) -> None:
    """vLLM level-1 sleep: device memory is freed (the control plane gives the reservation back)."""
    try:
        vllm.sleep(job.payload["base_url"], job.payload["api_key"])
    except BerthError as error:  # stays ready, and says why it did not sleep
        job.fail(error.message)
        return
    job.complete()


def wake(job: Job, node_name: str) -> None:
    """Wake into the memory the control plane claimed back, once the device has it free now."""
    payload = job.payload
    try:
        vllm.wake_up(payload["base_url"], payload["api_key"], reservation_bytes=payload["reservation_bytes"],
                     free_device_bytes=lambda: free_bytes(payload.get("accelerator")),
                     timeout=payload["timeout_seconds"])
    except BerthError as error:
        job.fail(error.message)
        return
    job.complete()


def free_bytes(accelerator: str | None) -> int | None:
    """Free memory now on the device a replica wakes into (this machine's RAM for a CPU one)."""
    if accelerator is None:
        return meminfo().get("MemAvailable")
    for gpu in discover_gpus(agent_nvml()).gpus:
        for device in (gpu, *gpu.mig_instances):
            if device.uuid == accelerator:
                if device.memory_total_bytes is None or device.memory_used_bytes is None:
                    return None
                return device.memory_total_bytes - device.memory_used_bytes
    return None
