"""What a node is asked to do with its engines, and what its reports mean: the control side of an
engine's life. The node's agent holds no database, broker or cluster secret; it claims these jobs
through the node API (``serving.control.node_jobs``: leased rows) and does what touches the engine
— fetching weights, launching, watching it load, stopping, sleeping, waking — while every state
change, reservation, start-up slot and lesson for the estimator is made here, from its reports.

A start, step by step (the agent's half is ``serving.node.lifecycle``):

1. ``to_node("start")`` queues a start job. At its claim the job names the weights the node may
   lack (``transfers``, with a link for each), which the agent fetches and reports file by file.
2. The agent asks to be admitted (report ``admit``): the start-up gate (``gate.claim``) and the
   node's memory, checked again at its turn. Admitted, it receives the launch: the engine's spec,
   its key (delivered only here, for the replica the node runs) and the start-up deadline. Not
   admitted, the replica waits ``queued`` and ``admit_next`` queues another start at its turn.
3. Launched, the agent reports the handle (``launched``): the replica is ``loading``. It watches
   the engine load, asking now and then whether it still should (``watching``).
4. The job completes ``ready`` with what the load took (peak resident memory, GPU readings), or
   fails with the engine's log tail and exit.

A stop is recorded here at once (``stopping``); the job that stops the engine is held back until
the gateways' requests in flight on it have drained, or the drain's grace has passed.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from berth.errors import BerthError
from scheduler import memory, recovery_service
from scheduler.models import Accelerator
from scheduler.nvml import DeviceMemory, load_memory
from serving import load, queues
from serving.catalog import transfer
from serving.control import failures, node_jobs
from serving.deployments import gate, states, stopping
from serving.deployments.states import accelerators_of
from serving.engines.base import LaunchSpec
from serving.keys import replica_key
from serving.models import DeploymentEvent, DeploymentState as S, ModelFile, NodeJob, Replica
from serving.models.states import BEFORE_START, SERVING, STARTING_UP, TERMINAL
from serving.runtimes.base import Exit, Handle

log = logging.getLogger(__name__)
START, STOP, SLEEP, WAKE, WATCH = "start", "stop", "sleep", "wake", "watch"
WATCHING_EVERY_SECONDS = 1.0  # how often a watching agent asks whether the replica should still load


# -- asking ------------------------------------------------------------------------------------

def fail(replica: Replica, message: str, *, handle: Handle | None = None, launch_failure: str = "") -> None:
    """The replica failed. With an engine that may still run (``handle``), the node stops it first and
    the failure is recorded with its log tail once the node reports; else it is recorded now."""
    if handle is None:
        failures.record(replica, message, launch_failure=launch_failure)
    else:
        stopping.stop_engine(replica, handle, {"state": S.FAILED, "message": message,
                                               "launch_failure": launch_failure})


def launch_spec(replica: Replica) -> LaunchSpec:
    """What the replica's engine is started and probed with on its node (its key among it)."""
    deployment = replica.deployment
    node = replica.node
    accelerator = Accelerator.objects.filter(uuid__in=deployment.gpu_uuids).first() if deployment.gpu_uuids else None
    limit = deployment.memory_reserved_bytes
    return LaunchSpec(
        replica_id=str(replica.public_id), engine=deployment.engine, model_path=deployment.path_on_node,
        served_name=deployment.name, host="127.0.0.1" if node.address in ("127.0.0.1", "localhost") else node.address,
        port=replica.port, api_key=replica_key(replica.public_id), config=deployment.config, cores=deployment.cores,
        # The container limit leaves a quarter above the estimate: the estimate is what we plan
        # with, the limit is the line past which the kernel stops a runaway engine.
        memory_limit_bytes=int(limit * 1.25) if limit else None, gpu_uuids=tuple(deployment.gpu_uuids),
        gpu_memory_total_bytes=accelerator.memory_total_bytes if accelerator else None, reservation_bytes=limit,
        labels={"berth.managed": "true", "berth.deployment": str(deployment.public_id),
                "berth.replica": str(replica.public_id), "berth.model": deployment.name})


def base_url(replica: Replica) -> str:
    spec = launch_spec(replica)
    return f"http://{spec.host}:{spec.port}"


def _launch(replica: Replica) -> dict:
    """What the node launches and watches a replica's engine with."""
    return {"spec": dataclasses.asdict(launch_spec(replica)), "runtime": replica.deployment.runtime,
            "task": replica.deployment.task, "startup_timeout_seconds": settings.SERVING_STARTUP_TIMEOUT_SECONDS,
            "margin_bytes": int(settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB * 2**30),
            "watching_every_seconds": WATCHING_EVERY_SECONDS}


def _replica(job: NodeJob) -> Replica | None:
    if job.replica_id is None:
        return None
    return Replica.objects.select_related("deployment", "node").filter(pk=job.replica_id).first()


# -- start and watch -----------------------------------------------------------------------------

def _start_claimed(job: NodeJob) -> dict | None:
    """A start that needs no weights takes its turn at the gate at once (one round trip fewer); one
    that does names them, and asks to be admitted once they are here."""
    replica = _replica(job)
    if replica is None or replica.state not in BEFORE_START:
        return None  # stopped before its start came, or started by another job
    if not replica.deployment.transfers:
        admitted = _admit(replica)
        return {"replica": str(replica.public_id), "launch": admitted} if admitted["admitted"] else None
    return {"replica": str(replica.public_id), "transfers": [_transfer(replica, move)
                                                             for move in replica.deployment.transfers],
            "freeable": _freeable(replica.node)}


def _transfer(replica: Replica, move: dict) -> dict:
    to = move["to"]
    recorded = ModelFile.objects.filter(node=replica.node, path=to, verified=True, quarantined=False,
                                        sha256=move["sha256"]).exists()
    catalogs_own = ModelFile.objects.filter(public_id=move["file"], node__isnull=True, path=to).exists()
    return {**move, "recorded": recorded, "catalogs_own": catalogs_own,
            "link": transfer.link_for(move["file"], replica.node)}


def _freeable(node) -> list[str]:
    """The node's copies it may delete for room, oldest first: quarantined ones and those no catalog
    model needs, never one an engine there uses nor the catalog's own file."""
    in_use = set(ModelFile.objects.filter(node__isnull=True).values_list("path", flat=True))
    for transfers in Replica.objects.filter(node=node, state__in=SERVING).values_list("deployment__transfers",
                                                                                       flat=True):
        in_use.update(move["to"] for move in transfers or ())
    copies = ModelFile.objects.filter(Q(model__isnull=True) | Q(quarantined=True), node=node).order_by("created_at")
    return [path for path in copies.values_list("path", flat=True) if path not in in_use]


def _start_report(job: NodeJob, event: str, data: dict) -> dict:
    replica = _replica(job)
    if replica is None:
        return {"go": False}
    if event == "say":
        _say(replica, str(data.get("message", ""))[:2000])
        return {}
    if event == "weights":
        _record_copy(replica, data)
        return {}
    if event == "freed":
        ModelFile.objects.filter(node=replica.node, path__in=[str(p) for p in data.get("paths", ())]).delete()
        return {}
    if event == "admit":
        return _admit(replica)
    if event == "launched":
        handle = Handle(**data["handle"])
        if replica.state == S.STARTING and states.move(replica, S.LOADING, f"{handle.runtime} runtime started the "
                                                       "engine", handle=dataclasses.asdict(handle)):
            return {"go": True}
        return {"go": False}  # stopped while it was starting: the node stops the engine it launched
    if event == "watching":
        replica.refresh_from_db(fields=["state"])
        return {"go": replica.state == S.LOADING}
    raise node_jobs.UnknownReport(f"A {job.kind} job does not report {event!r}.")


def _admit(replica: Replica) -> dict:
    """The replica's turn at the start-up gate; admitted, its memory is checked again at once."""
    if not gate.claim(replica):
        return {"admitted": False}
    deployment = replica.deployment
    try:  # at its turn, the fit is checked again against what the node has now
        memory.reserve_shards(replica.node, states.holder_of(replica), replica.memory_reserved_bytes,
                              accelerators_of(deployment), description=f"{deployment.name} ({deployment.engine})")
    except BerthError as error:
        failures.record(replica, f"no longer fits at its turn: {error.message}")
        _admit_next_once_committed(replica)  # it will not start: the next in line may
        return {"admitted": False}
    return {"admitted": True, **_launch(replica)}


def _say(replica: Replica, message: str) -> None:
    DeploymentEvent.objects.create(deployment=replica.deployment, replica=replica, from_state=replica.state,
                                   to_state=replica.state, message=message)


def _record_copy(replica: Replica, data: dict) -> None:
    """The node's copy of a file as it arrived: verified, or (another SHA-256) quarantined with why."""
    move = next((m for m in replica.deployment.transfers or () if m["to"] == data.get("to")), None)
    if move is None:
        return  # not a file this replica's node was asked to fetch
    found = str(data.get("sha256") or move["sha256"])
    source = ModelFile.objects.filter(public_id=move["file"]).first()
    bad = found != move["sha256"]
    ModelFile.objects.update_or_create(node=replica.node, path=move["to"], defaults={
        "model": source.model if source else None, "repo_path": move["repo_path"], "size": move["size"],
        "sha256": found, "expected_sha256": move["sha256"], "verified": not bad, "quarantined": bad,
        "quarantine_reason": f"its transfer to {replica.node.name} arrived with SHA-256 {found}, not {move['sha256']}"
        if bad else ""})


def _watch_claimed(job: NodeJob) -> dict | None:
    replica = _replica(job)
    if replica is None or replica.state != S.LOADING or not replica.handle:
        return None
    return {"replica": str(replica.public_id), "handle": replica.handle, **_launch(replica)}


def _loaded(job: NodeJob, result: dict) -> dict:
    """A start or watch ended on the node: ready (what the load took is taught to the estimator),
    queued (not admitted), or its engine stopped because the replica was stopped while it started."""
    replica = _replica(job)
    outcome = result.get("outcome")
    if replica is None or outcome == "queued":
        return {}  # (queued: it waits its turn, and ``admit_next`` sends it again then)
    _admit_next_once_committed(replica)
    if outcome == "ready" and replica.state == S.LOADING:  # (not stopped while it loaded)
        peak = result.get("peak_memory_bytes")
        if states.move(replica, S.READY, "health answered and a real request succeeded", peak_memory_bytes=peak,
                       **_load_stamps(result.get("load_seconds"))):
            recovery_service.note_success(replica.deployment.name)
            # What the load taught, once it is ready for all to see (reading the model takes a while).
            transaction.on_commit(lambda: failures.calibrate(replica, peak, _gpu_taken(replica, result.get("gpu"))
                                                             if replica.deployment.gpu_uuids else None))
    elif outcome == "stopped":
        _finish_stop_while_starting(replica)
    return {}


def _load_stamps(load_seconds) -> dict:
    """``started_at`` and ``ready_at`` a load's own length apart, as the node timed it from its engine's
    launch to its readiness (its clock is not ours, but a length on it is): the reports' round trips
    are no part of the engine's load. Nothing when the node did not time it (an engine an earlier agent
    launched) or said something no load takes."""
    if isinstance(load_seconds, bool) or not isinstance(load_seconds, (int, float)) \
            or not 0 <= load_seconds <= settings.SERVING_STARTUP_TIMEOUT_SECONDS:
        return {}
    now = timezone.now()
    return {"started_at": now - timedelta(seconds=load_seconds), "ready_at": now}


def _load_failed(job: NodeJob, error: str, details: dict) -> dict:
    replica = _replica(job)
    if replica is None:
        return {}
    _admit_next_once_committed(replica)
    # A replica stopped meanwhile is its stop's: an engine its stop ended is no failure of the model.
    if replica.state not in (*TERMINAL, S.STOPPING):
        failures.record(replica, error, log_tail=str(details.get("log_tail") or ""),
                        exit=exit_of(details.get("exit")), launch_failure=str(details.get("launch_failure") or ""))
    _finish_stop_while_starting(replica)
    return {}


def exit_of(data: dict | None) -> Exit | None:
    return Exit(**{k: data.get(k) for k in ("code", "signal", "oom_evidence")}) if data else None


def _finish_stop_while_starting(replica: Replica) -> None:
    """A stop that came while the engine was being launched moved the replica from ``starting`` to
    ``stopping`` before its handle was recorded. Only the start knew that engine, so the stop is
    finished once the node says it stopped it (or never launched one): the row says stopped only
    when no engine of it runs."""
    replica.refresh_from_db(fields=["state", "handle"])
    if replica.state != S.STOPPING or replica.handle:
        return  # not stopped meanwhile, or stopped once its handle was recorded: its stop job owns that
    states.move(replica, S.STOPPED, "stopped while it was starting: its engine was stopped before it loaded")


def _gpu_taken(replica: Replica, gpu: dict | None):
    """The device memory the engine took on its GPUs, from the node's readings: its processes' own
    figures where the driver gives them, else each device's use now less before it started."""
    if not gpu:
        return None
    uuids = replica.deployment.gpu_uuids
    before = _readings(gpu.get("before"))
    since = replica.events.filter(to_state=S.STARTING).order_by("-at").values_list("at", flat=True).first()
    taken = load_memory(uuids, set(gpu.get("pids") or ()), _readings(gpu.get("after")) or {}, before,
                        delta_spoiled=_others_moved(replica, since) if before is not None and since else "")
    if taken.bytes is not None:
        log.info("%s took %s B of device memory (%s: %s)", replica, f"{taken.bytes:,}", taken.method,
                 dict(taken.per_device))
    return taken


def _readings(data: dict | None) -> dict[str, DeviceMemory] | None:
    if data is None:
        return None
    return {uuid_: DeviceMemory(uuid=uuid_, used_bytes=reading.get("used_bytes"),
                                processes=None if reading.get("processes") is None else
                                {int(pid): used for pid, used in reading["processes"].items()})
            for uuid_, reading in data.items()}


def _others_moved(replica: Replica, since) -> str:
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


# -- stop ----------------------------------------------------------------------------------------

STOPPED_THEN = {"state": S.STOPPED, "message": "stopped"}


def _then(job: NodeJob) -> dict:
    """What a stop's completion records: a plain stop (no payload) moves its stopping replica to stopped."""
    return job.payload.get("then") or STOPPED_THEN


def _drained(job: NodeJob) -> bool:
    """A plain stop's engine is stopped once the gateways' requests in flight on it have finished (no
    new ones are routed to a stopping replica), or the drain's grace has passed, or no load is known."""
    if job.payload.get("handle"):
        return True  # a failed engine, or one nobody routes to: nothing to drain
    if timezone.now() >= job.created_at + timedelta(seconds=settings.SERVING_DRAIN_SECONDS):
        return True
    replica_id = Replica.objects.filter(pk=job.replica_id).values_list("public_id", flat=True).first()
    try:
        return load.current().in_flight.get(str(replica_id), 0) == 0
    except Exception as error:  # noqa: BLE001 - no report to go by: stop now rather than hang
        log.warning("draining %s: load unknown (%s); stopping now", replica_id, error)
        return True


def _stop_claimed(job: NodeJob) -> dict | None:
    """A plain stop is of the engine the stopping replica's row names, read now."""
    if job.payload.get("handle"):
        return {}
    replica = _replica(job)
    if replica is None or replica.state != S.STOPPING:
        return None  # stopped meanwhile (its start stopped its engine, or another stop did)
    if not replica.handle:  # no engine of it is known to run on the node
        states.move(replica, S.STOPPED, "stopped: no engine of it was running")
        _admit_next_once_committed(replica)
        return None
    return {"handle": replica.handle, "then": STOPPED_THEN}


def _stopped(job: NodeJob, result: dict) -> dict:
    replica = _replica(job)
    then = _then(job)
    if replica is None:
        return {}
    exit = exit_of(result.get("exit"))
    ended = f" ({exit.describe()})" if exit else ""
    try:
        if then.get("state") == S.STOPPED:
            if replica.state == S.STOPPING:
                states.move(replica, S.STOPPED, (then.get("message") or "stopped") + ended)
        elif then.get("state") == S.FAILED:
            failures.record(replica, then.get("message") or "failed", log_tail=str(result.get("log_tail") or ""),
                            exit=exit, launch_failure=then.get("launch_failure") or "")
        elif then.get("message"):
            _say(replica, then["message"] + ended)
    finally:
        admit_next(replica.node_id)
    return {}


def _stop_failed(job: NodeJob, error: str, details: dict) -> dict:
    replica = _replica(job)
    if replica is not None:
        _say(replica, f"its engine could not be stopped: {error}"[:2000])
    return {}


# -- sleep and wake ------------------------------------------------------------------------------

def _sleep_claimed(job: NodeJob) -> dict | None:
    replica = _replica(job)
    if replica is None or replica.state != S.READY:
        return None
    return {"base_url": base_url(replica), "api_key": replica_key(replica.public_id)}


def _slept(job: NodeJob, result: dict) -> dict:
    replica = _replica(job)
    if replica is not None and states.move(replica, S.SLEEPING, "asleep: its device memory is free"):
        memory.release_reservation(states.holder_of(replica))
        admit_next(replica.node_id)  # a start waiting for this memory (put to sleep to make room) may go
    return {}


def _sleep_failed(job: NodeJob, error: str, details: dict) -> dict:
    replica = _replica(job)
    if replica is not None:  # stays ready, and says why it did not sleep
        DeploymentEvent.objects.create(deployment=replica.deployment, replica=replica, from_state=replica.state,
                                       to_state=replica.state, message=f"could not sleep: {error}"[:2000])
    return {}


def _wake_claimed(job: NodeJob) -> dict | None:
    """Claim the memory back under the node's lock, then take a start-up slot like a start: on
    unified memory an engine waking while another profiles its memory breaks that start. With every
    slot taken the wake waits its turn, asleep and holding the memory it claimed; ``admit_next``
    asks again when its turn comes. Refused (left asleep, its memory given back, the reason an
    event) when the memory is not free; given up the same way past ``SERVING_WAKE_TIMEOUT_SECONDS``."""
    replica = _replica(job)
    if replica is None or replica.state != S.SLEEPING or replica.waking_since is not None:
        return None  # awake, ended, or this wake holds its slot already (a second dispatch of it)
    gate.ask_wake(replica)  # a wake sent without the verb takes its place in line too
    if replica.state != S.SLEEPING:
        return None
    if timezone.now() >= gate.wake_deadline(replica):
        end_wake(replica, f"wake given up: not awake within {settings.SERVING_WAKE_TIMEOUT_SECONDS}s of being asked")
        _admit_next_once_committed(replica)
        return None
    deployment = replica.deployment
    accelerators = accelerators_of(deployment)
    try:
        memory.reserve_shards(replica.node, states.holder_of(replica), replica.memory_reserved_bytes, accelerators,
                              description=f"{deployment.name} (waking)")
    except BerthError as error:
        end_wake(replica, f"wake refused: {error.message}")
        _admit_next_once_committed(replica)  # starts behind it in line go on
        return None
    if not gate.claim_wake(replica):
        if replica.state == S.SLEEPING and replica.wake_requested_at is not None:
            if replica.waking_since is None:
                _note_waiting(replica)  # its turn comes through ``admit_next``; the memory stays claimed
            return None  # (or another dispatch of this wake took the slot meanwhile)
        if replica.state == S.SLEEPING:  # given up while it claimed the memory: a sleeping replica holds none
            memory.release_reservation(states.holder_of(replica))
        return None
    left = (gate.wake_deadline(replica) - timezone.now()).total_seconds()
    return {"base_url": base_url(replica), "api_key": replica_key(replica.public_id),
            "reservation_bytes": replica.memory_reserved_bytes, "timeout_seconds": max(left, 5),
            "accelerator": accelerators[0].uuid if accelerators else None}


def _woke(job: NodeJob, result: dict) -> dict:
    replica = _replica(job)
    if replica is None:
        return {}
    try:
        if not states.move(replica, S.READY, "awake", wake_requested_at=None, waking_since=None):
            # Stopped while it woke: that stop owns the replica now; only the slot is handed back.
            Replica.objects.filter(pk=replica.pk).update(wake_requested_at=None, waking_since=None)
    finally:
        admit_next(replica.node_id)
    return {}


def _wake_failed(job: NodeJob, error: str, details: dict) -> dict:
    replica = _replica(job)
    if replica is None:
        return {}
    try:
        end_wake(replica, f"wake refused: {error}")
    finally:
        admit_next(replica.node_id)
    return {}


def _note_waiting(replica: Replica) -> None:
    """An event, once per wake, saying where in line it waits."""
    if replica.events.filter(at__gte=replica.wake_requested_at, message__startswith="wake waits").exists():
        return
    DeploymentEvent.objects.create(
        deployment=replica.deployment, replica=replica, from_state=S.SLEEPING, to_state=S.SLEEPING,
        message=f"wake waits for a start-up slot on {replica.node.name} (position {gate.position(replica)}; "
                f"{gate.busy(replica.node_id)} starting or waking); its memory is claimed")


def end_wake(replica: Replica, message: str) -> bool:
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


# -- the line ------------------------------------------------------------------------------------

def admit_next(node_id: int) -> None:
    """Give a free start-up slot to the next in line on the node: a queued start or a waiting wake,
    first come first served. Wakes past their deadline give up first (each heartbeat calls this, so a
    wake gives up within a beat of its deadline even when no slot frees)."""
    for replica in gate.expired_wakes(node_id):
        cut_off = replica.waking_since is not None
        end_wake(replica, f"wake given up: {'its wake never finished' if cut_off else 'no start-up slot came'} "
                          f"within {settings.SERVING_WAKE_TIMEOUT_SECONDS}s of being asked")
    if gate.busy(node_id) >= settings.SERVING_STARTUP_SLOTS:
        return
    waiting = gate.next_in_line(node_id)
    if waiting is not None:
        queues.to_node(WAKE if waiting.state == S.SLEEPING else START, waiting)


def _admit_next_once_committed(replica: Replica) -> None:
    """The next in line on ``replica``'s node is sent once what freed its slot (or gave up its turn)
    commits: that end is seen without waiting on the line, and a rolled-back one frees nothing (each
    heartbeat looks again)."""
    transaction.on_commit(lambda: admit_next(replica.node_id), robust=True)


def register() -> None:
    """Say what each kind of engine job means (the app's ``ready`` calls this)."""
    node_jobs.register(START, claimed=_start_claimed, report=_start_report, complete=_loaded, fail=_load_failed)
    node_jobs.register(WATCH, claimed=_watch_claimed, report=_start_report, complete=_loaded, fail=_load_failed)
    node_jobs.register(STOP, claimable=_drained, claimed=_stop_claimed, complete=_stopped, fail=_stop_failed)
    node_jobs.register(SLEEP, claimed=_sleep_claimed, complete=_slept, fail=_sleep_failed)
    node_jobs.register(WAKE, claimed=_wake_claimed, complete=_woke, fail=_wake_failed)
