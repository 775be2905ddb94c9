"""An engine's life on its node: start (through the start-up gate), watch it load, stop it (letting
in-flight requests drain first), sleep and wake it. The agent's tasks land here (``serving.tasks``);
a failure goes to ``failures``; what an earlier agent left is ``adopt``'s, the beat ``heartbeat``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import datetime
from pathlib import Path

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from berth.errors import BerthError
from scheduler import memory, recovery_service
from scheduler.models import Node
from scheduler.nvml import DeviceMemory, LoadMemory, load_memory
from serving import load, queues
from serving.deployments import gate, states
from serving.deployments.service import accelerators_of
from serving.engines import vllm
from serving.engines.registry import engine_for
from serving.keys import replica_key
from serving.models import DeploymentEvent, DeploymentState as S, Replica
from serving.models.states import BEFORE_START, STARTING_UP, TERMINAL
from serving.node import failures, weights
from serving.node.discovery import device_memory, meminfo
from serving.node.runtime import base_url, handle_of, launch_spec, runtime_for
from serving.runtimes.base import Handle

log = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # readiness polling: an engine answering /health is noticed within 50 ms
DRAIN_POLL_SECONDS = 0.5  # the gateways report their load every 2 s


def start_replica(replica_id: str) -> None:
    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is None or replica.state not in BEFORE_START:
        return
    # The weights this node lacks first, before a start-up slot is taken: a long transfer must not
    # hold the node's other starts back.
    if replica.deployment.transfers and not weights.ensure(replica):
        return
    if not gate.claim(replica):
        return
    try:
        _start(replica)
    finally:
        _finish_stop_while_starting(replica)
        admit_next(replica.node_id)


def _finish_stop_while_starting(replica: Replica) -> None:
    """A stop that came while the engine was being launched moved the replica from ``starting`` to
    ``stopping`` before its handle was recorded. Only this start knows that engine, so the stop is
    finished here, once ``_start`` has stopped the engine (or never launched one): the row says
    stopped only when no engine of it runs."""
    replica.refresh_from_db(fields=["state", "handle"])
    if replica.state != S.STOPPING or replica.handle:
        return  # not stopped meanwhile, or stopped once its handle was recorded: ``stop_replica`` owns that
    states.move(replica, S.STOPPED, "stopped while it was starting: its engine was stopped before it loaded")


def _start(replica: Replica) -> None:
    deployment, node = replica.deployment, replica.node
    try:  # at its turn, the fit is checked again against what the node has now
        memory.reserve_shards(node, states.holder_of(replica), replica.memory_reserved_bytes, accelerators_of(deployment),
                              description=f"{deployment.name} ({deployment.engine})")
    except BerthError as error:
        failures.fail(replica, f"no longer fits at its turn: {error.message}")
        return
    runtime = runtime_for(deployment.runtime)
    before = _read_gpus(deployment)  # the device delta's "before", should the driver not count per process
    try:
        engine = engine_for(deployment.engine)
        spec = launch_spec(replica)
        handle = runtime.start(spec, engine.command(spec))
    except BerthError as error:
        failures.fail(replica, f"could not start: {error.message}", launch_failure="crash")
        return
    except Exception as error:  # the runtime's own failure (docker daemon gone, exec error)
        log.exception("starting %s failed", replica)
        failures.fail(replica, f"could not start: {error}", launch_failure="crash")
        return
    if not states.move(replica, S.LOADING, f"{runtime.kind} runtime started the engine", handle=dataclasses.asdict(handle)):
        runtime.stop(handle, grace_seconds=5)  # stopped while starting: do not leave it running
        return  # the caller finishes the stop (``_finish_stop_while_starting``)
    watch_startup(replica, before=before)


def watch_startup(replica: Replica, *, before: GpuReading | None = None) -> None:
    """Loading → ready once /health answers 200 and one real request succeeds; failed when the
    engine exits, memory runs short, or the start-up timeout passes. Once ready, what the load took
    is measured (``before``: the replica's GPUs as read before its engine started; an adopted
    engine has none) and taught to the estimator."""
    deployment = replica.deployment
    runtime, handle = runtime_for(deployment.runtime), handle_of(replica)
    engine = engine_for(deployment.engine)
    spec = launch_spec(replica)
    base = f"http://{spec.host}:{spec.port}"
    headers = {"Authorization": f"Bearer {spec.api_key}"}
    deadline = time.monotonic() + settings.SERVING_STARTUP_TIMEOUT_SECONDS
    margin = settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB * 2**30
    with httpx.Client(timeout=10) as http:
        while True:
            replica.refresh_from_db(fields=["state"])
            if replica.state != S.LOADING:
                return  # stopped (or failed) by someone else meanwhile
            status = runtime.status(handle)
            if not status.running:
                failures.fail(replica, f"engine {status.exit.describe() if status.exit else 'vanished'} while loading",
                     handle=handle, exit=status.exit, launch_failure="crash")
                return
            available = _mem_available()  # the agent runs on the replica's node: this machine's figure
            if available is not None and margin and available < margin and not deployment.gpu_uuids:
                failures.fail(replica, f"available memory fell to {available / 2**30:.1f} GiB, below the safety margin, "
                              "during start-up", handle=handle)
                return
            if _ready(http, base, headers, engine, spec, deployment.task):
                peak = runtime.status(handle).peak_memory_bytes
                gpu = _gpu_memory_taken(replica, handle, before) if deployment.gpu_uuids else None
                if states.move(replica, S.READY, "health answered and a real request succeeded",
                               peak_memory_bytes=peak):
                    recovery_service.note_success(deployment.name)
                failures.calibrate(replica, peak, gpu)
                return
            if time.monotonic() > deadline:
                failures.fail(replica, f"not ready within {settings.SERVING_STARTUP_TIMEOUT_SECONDS}s", handle=handle,
                     launch_failure="hang")
                return
            time.sleep(POLL_SECONDS)


@dataclasses.dataclass(frozen=True)
class GpuReading:
    """A replica's GPUs as read just before its engine started, and when."""

    at: datetime
    devices: dict[str, DeviceMemory]


def _read_gpus(deployment) -> GpuReading | None:
    if not deployment.gpu_uuids:
        return None
    return GpuReading(at=timezone.now(), devices=device_memory(deployment.gpu_uuids))


def _gpu_memory_taken(replica: Replica, handle: Handle, before: GpuReading | None) -> LoadMemory:
    """The device memory the engine took on its GPUs, read now that it is ready: its processes' own
    figures where the driver gives them, else each device's use now less before it started."""
    uuids = replica.deployment.gpu_uuids
    taken = load_memory(uuids, _engine_pids(handle), device_memory(uuids), before and before.devices,
                        delta_spoiled=_others_moved(replica, before.at) if before else "")
    if taken.bytes is not None:
        log.info("%s took %s B of device memory (%s: %s)", replica, f"{taken.bytes:,}", taken.method,
                 dict(taken.per_device))
    return taken


def _others_moved(replica: Replica, since: datetime) -> str:
    """Why another engine may have changed the replica's GPUs' use since ``since`` (empty when none
    did): another replica on any of them started, stopped, slept or woke, or is starting or stopping."""
    uuids = set(replica.deployment.gpu_uuids)
    moved = DeploymentEvent.objects.filter(at__gte=since, replica__isnull=False, replica__node_id=replica.node_id) \
        .exclude(replica_id=replica.pk).values_list("replica__public_id", "deployment__gpu_uuids")
    busy = Replica.objects.filter(node_id=replica.node_id, state__in=(*STARTING_UP, S.STOPPING)) \
        .exclude(pk=replica.pk).values_list("public_id", "deployment__gpu_uuids")
    for other, gpus in (*moved, *busy):
        if uuids & set(gpus or ()):
            return f"replica {other} on the same GPU started, stopped, slept or woke meanwhile"
    return ""


def _engine_pids(handle: Handle) -> set[int]:
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


def _mem_available() -> int | None:
    return meminfo().get("MemAvailable")


def stop_replica(replica_id: str) -> None:
    replica = _claim_stop(replica_id)
    if replica is None:
        return
    drain(replica, settings.SERVING_DRAIN_SECONDS)
    handle = handle_of(replica)
    exit = runtime_for(handle.runtime).stop(handle) if handle else None
    states.move(replica, S.STOPPED, "stopped" + (f" ({exit.describe()})" if exit else ""))
    admit_next(replica.node_id)


def _claim_stop(replica_id: str) -> Replica | None:
    """Record the stop on the replica's row: cancelled at once when it has not started, else moved
    to ``stopping``. Each move is conditional on the state just read; when a start moved the replica
    meanwhile (say ``starting`` → ``loading``), it is read again and the stop tried again, so a stop
    is never lost to a start. Returns the replica whose engine this stop must now stop, or None
    (nothing runs, or the start in progress stops its own engine)."""
    while True:
        replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
        if replica is None or replica.state in TERMINAL:
            return None
        if replica.state in BEFORE_START:
            if states.move(replica, S.STOPPED, "cancelled before it started"):
                return None
            continue
        if replica.state == S.STOPPING:
            # Stopped while starting, before the engine's handle was recorded: its start stops it.
            return replica if replica.handle else None
        launching = replica.state == S.STARTING
        message = "stopping: the start in progress stops its engine once launched" if launching else "stopping"
        if states.move(replica, S.STOPPING, message):
            return None if launching else replica


def drain(replica: Replica, grace: float) -> bool:
    """Let the requests the gateways still have in flight on a stopping replica finish (no new
    ones are routed to it), for at most ``grace`` seconds. True when none is left."""
    deadline = time.monotonic() + grace
    key = str(replica.public_id)
    while True:
        try:
            busy = load.current().in_flight.get(key, 0)
        except Exception as error:  # noqa: BLE001 - no report to go by: stop now rather than hang
            log.warning("draining %s: load unknown (%s); stopping now", replica, error)
            return False
        if busy == 0:
            return True
        if time.monotonic() >= deadline:
            log.info("%s still had %d request(s) in flight after %.0f s; stopping it", replica, busy, grace)
            return False
        time.sleep(DRAIN_POLL_SECONDS)


def sleep_replica(replica_id: str) -> None:
    """vLLM level-1 sleep: device memory is freed, so the replica's memory reservation is given back."""
    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is None or replica.state != S.READY:
        return
    try:
        vllm.sleep(base_url(replica), replica_key(replica.public_id))
    except BerthError as error:  # stays ready, and says why it did not sleep
        DeploymentEvent.objects.create(deployment=replica.deployment, replica=replica, from_state=S.READY,
                                       to_state=S.READY, message=f"could not sleep: {error.message}")
        return
    if states.move(replica, S.SLEEPING, "asleep: its device memory is free"):
        memory.release_reservation(states.holder_of(replica))
        admit_next(replica.node_id)  # a start waiting for this memory (put to sleep to make room) may go


def wake_replica(replica_id: str) -> None:
    """Claim the memory back under the node's lock, then take a start-up slot like a start: on
    unified memory an engine waking while another profiles its memory breaks that start. With every
    slot taken the wake waits its turn, asleep and holding the memory it claimed; ``admit_next``
    sends it again when its turn comes. Refused (left asleep, its memory given back, the reason an
    event) when the memory is not free; given up the same way past ``SERVING_WAKE_TIMEOUT_SECONDS``."""
    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is None or replica.state != S.SLEEPING or replica.waking_since is not None:
        return  # awake, ended, or this wake holds its slot already (a second dispatch of it)
    gate.ask_wake(replica)  # a wake sent without the verb takes its place in line too
    if replica.state != S.SLEEPING:
        return
    if timezone.now() >= gate.wake_deadline(replica):
        _end_wake(replica, f"wake given up: not awake within {settings.SERVING_WAKE_TIMEOUT_SECONDS}s of being asked")
        admit_next(replica.node_id)
        return
    deployment = replica.deployment
    accelerators = accelerators_of(deployment)
    accelerator = accelerators[0] if accelerators else None
    try:
        memory.reserve_shards(replica.node, states.holder_of(replica), replica.memory_reserved_bytes, accelerators,
                              description=f"{deployment.name} (waking)")
    except BerthError as error:
        _end_wake(replica, f"wake refused: {error.message}")
        admit_next(replica.node_id)  # starts behind it in line go on
        return
    if not gate.claim_wake(replica):
        if replica.state == S.SLEEPING and replica.wake_requested_at is not None:
            if replica.waking_since is None:
                _note_waiting(replica)  # its turn comes through ``admit_next``; the memory stays claimed
            return  # (or another dispatch of this wake took the slot meanwhile)
        if replica.state == S.SLEEPING:  # given up while it claimed the memory: a sleeping replica holds none
            memory.release_reservation(states.holder_of(replica))
        return
    try:
        left = (gate.wake_deadline(replica) - timezone.now()).total_seconds()
        vllm.wake_up(base_url(replica), replica_key(replica.public_id),
                     reservation_bytes=replica.memory_reserved_bytes,
                     free_device_bytes=lambda: _free_bytes(replica.node, accelerator), timeout=max(left, 5))
    except BerthError as error:
        _end_wake(replica, f"wake refused: {error.message}")
    else:
        if not states.move(replica, S.READY, "awake", wake_requested_at=None, waking_since=None):
            # Stopped while it woke: that stop owns the replica now; only the slot is handed back.
            Replica.objects.filter(pk=replica.pk).update(wake_requested_at=None, waking_since=None)
    finally:
        admit_next(replica.node_id)


def _note_waiting(replica: Replica) -> None:
    """An event, once per wake, saying where in line it waits."""
    if replica.events.filter(at__gte=replica.wake_requested_at, message__startswith="wake waits").exists():
        return
    DeploymentEvent.objects.create(
        deployment=replica.deployment, replica=replica, from_state=S.SLEEPING, to_state=S.SLEEPING,
        message=f"wake waits for a start-up slot on {replica.node.name} (position {gate.position(replica)}; "
                f"{gate.busy(replica.node_id)} starting or waking); its memory is claimed")


def _end_wake(replica: Replica, message: str) -> bool:
    """The wake ends with the replica asleep: out of line, its slot and claimed memory given back,
    and the reason an event. Conditional on the wake the caller saw, so a wake ends once."""
    with transaction.atomic():
        ended = Replica.objects.filter(pk=replica.pk, state=S.SLEEPING, wake_requested_at=replica.wake_requested_at) \
            .update(wake_requested_at=None, waking_since=None)
        if not ended:
            return False
        memory.release_reservation(states.holder_of(replica))
        DeploymentEvent.objects.create(deployment=replica.deployment, replica=replica, from_state=S.SLEEPING,
                                       to_state=S.SLEEPING, message=message[:2000])
    replica.wake_requested_at = replica.waking_since = None
    return True


def _free_bytes(node: Node, accelerator) -> int | None:
    """Free memory now on the device the replica wakes into (the node's for a CPU placement)."""
    node.refresh_from_db(fields=["memory_available_bytes"])
    if accelerator is None:
        return node.memory_available_bytes
    accelerator.refresh_from_db()
    if accelerator.memory_total_bytes is None or accelerator.memory_used_bytes is None:
        return None
    return accelerator.memory_total_bytes - accelerator.memory_used_bytes


def admit_next(node_id: int) -> None:
    """Give a free start-up slot to the next in line on the node: a queued start or a waiting wake,
    first come first served. Wakes past their deadline give up first (the heartbeat calls this
    every beat, so a wake gives up within a beat of its deadline even when no slot frees)."""
    for replica in gate.expired_wakes(node_id):
        cut_off = replica.waking_since is not None
        _end_wake(replica, f"wake given up: {'its wake never finished' if cut_off else 'no start-up slot came'} "
                           f"within {settings.SERVING_WAKE_TIMEOUT_SECONDS}s of being asked")
    if gate.busy(node_id) >= settings.SERVING_STARTUP_SLOTS:
        return
    waiting = gate.next_in_line(node_id)
    if waiting is not None:
        queues.to_node("wake" if waiting.state == S.SLEEPING else "start", waiting)
