"""The node agent: everything that touches engines on one machine.

``manage.py agent --node NAME`` runs a Celery worker on the queue ``node.NAME``; the tasks in
``serving.tasks`` land here. A heartbeat thread in the same worker re-registers the node every
few seconds (telemetry, engines), checks that engines which should run still do, times out
queued starts and admits the next one in line. Engines run in their own sessions (or containers)
and outlive the agent; when it comes back it adopts them from the replica rows' handles.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import httpx
from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from berth.errors import BerthError
from scheduler import memory, recovery_service
from scheduler.estimation.reading import read_model
from scheduler.models import Accelerator, Node
from scheduler.policy import recovery
from scheduler.policy.calibration import ExitClassification
from serving import load, watchdog
from serving.deployments import gate, states
from serving.deployments.service import accelerators_of, estimation_config, holder_of, release
from serving.engines.registry import engine_for
from serving.engines.base import LaunchSpec
from serving.keys import replica_key
from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica
from serving.runtimes.base import Exit, Handle

log = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # readiness polling: an engine answering /health is noticed within 50 ms
DRAIN_POLL_SECONDS = 0.5  # the gateways report their load every 2 s
_runtimes: dict = {}


def node_name() -> str | None:
    return os.environ.get("BERTH_AGENT_NODE")


def runtime_for(kind: str):
    """One runtime object per kind for the agent's life: a process runtime remembers the engines it
    started (their exit statuses reach only their parent)."""
    if kind not in _runtimes:
        from serving.runtimes.registry import runtime_for as make

        _runtimes[kind] = make(kind)
    return _runtimes[kind]


def launch_spec(replica: Replica) -> LaunchSpec:
    deployment = replica.deployment
    node = replica.node
    accelerator = Accelerator.objects.filter(uuid__in=deployment.gpu_uuids).first() if deployment.gpu_uuids else None
    limit = deployment.memory_reserved_bytes
    return LaunchSpec(
        replica_id=str(replica.public_id), engine=deployment.engine, model_path=deployment.model_path,
        served_name=deployment.name, host="127.0.0.1" if node.address in ("127.0.0.1", "localhost") else node.address,
        port=replica.port, api_key=replica_key(replica.public_id), config=deployment.config, cores=deployment.cores,
        # The container limit leaves a quarter above the estimate: the estimate is what we plan
        # with, the limit is the line past which the kernel stops a runaway engine.
        memory_limit_bytes=int(limit * 1.25) if limit else None, gpu_uuids=tuple(deployment.gpu_uuids),
        gpu_memory_total_bytes=accelerator.memory_total_bytes if accelerator else None, reservation_bytes=limit,
        labels={"berth.managed": "true", "berth.deployment": str(deployment.public_id),
                "berth.replica": str(replica.public_id), "berth.model": deployment.name})


def _handle(replica: Replica) -> Handle | None:
    return Handle(**replica.handle) if replica.handle else None


def start_replica(replica_id: str) -> None:
    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is None or not gate.claim(replica):
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
    with transaction.atomic():
        if states.move(replica, S.STOPPED, "stopped while it was starting: its engine was stopped before it loaded"):
            release(replica)


def _start(replica: Replica) -> None:
    deployment, node = replica.deployment, replica.node
    try:  # at its turn, the fit is checked again against what the node has now
        memory.reserve_shards(node, holder_of(replica), replica.memory_reserved_bytes, accelerators_of(deployment),
                              description=f"{deployment.name} ({deployment.engine})")
    except BerthError as error:
        fail(replica, f"no longer fits at its turn: {error.message}")
        return
    runtime = runtime_for(deployment.runtime)
    try:
        engine = engine_for(deployment.engine)
        spec = launch_spec(replica)
        handle = runtime.start(spec, engine.command(spec))
    except BerthError as error:
        fail(replica, f"could not start: {error.message}", launch_failure="crash")
        return
    except Exception as error:  # the runtime's own failure (docker daemon gone, exec error)
        log.exception("starting %s failed", replica)
        fail(replica, f"could not start: {error}", launch_failure="crash")
        return
    if not states.move(replica, S.LOADING, f"{runtime.kind} runtime started the engine", handle=dataclasses.asdict(handle)):
        runtime.stop(handle, grace_seconds=5)  # stopped while starting: do not leave it running
        return  # the caller finishes the stop (``_finish_stop_while_starting``)
    watch_startup(replica)


def watch_startup(replica: Replica) -> None:
    """Loading → ready once /health answers 200 and one real request succeeds; failed when the
    engine exits, memory runs short, or the start-up timeout passes."""
    deployment = replica.deployment
    runtime, handle = runtime_for(deployment.runtime), _handle(replica)
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
                fail(replica, f"engine {status.exit.describe() if status.exit else 'vanished'} while loading",
                     handle=handle, exit=status.exit, launch_failure="crash")
                return
            available = _mem_available()  # the agent runs on the replica's node: this machine's figure
            if available is not None and margin and available < margin and not deployment.gpu_uuids:
                fail(replica, f"available memory fell to {available / 2**30:.1f} GiB, below the safety margin, "
                              "during start-up", handle=handle)
                return
            if _ready(http, base, headers, engine, spec, deployment.task):
                peak = runtime.status(handle).peak_memory_bytes
                if states.move(replica, S.READY, "health answered and a real request succeeded",
                               peak_memory_bytes=peak):
                    recovery_service.note_success(deployment.name)
                _calibrate(replica, peak)
                return
            if time.monotonic() > deadline:
                fail(replica, f"not ready within {settings.SERVING_STARTUP_TIMEOUT_SECONDS}s", handle=handle,
                     launch_failure="hang")
                return
            time.sleep(POLL_SECONDS)


def _ready(http, base, headers, engine, spec, task) -> bool:
    try:
        if http.get(base + engine.health_path(), headers=headers, timeout=2).status_code != 200:
            return False
        probe = engine.probe(spec, task)
        return http.post(base + probe.path, json=probe.body, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def _mem_available() -> int | None:
    from serving.discovery import meminfo

    return meminfo().get("MemAvailable")


def fail(replica: Replica, message: str, *, handle: Handle | None = None, exit: Exit | None = None,
         launch_failure: str = "") -> None:
    """Remove a failed engine, keep its log tail, give back what it held, learn from an OOM.

    ``launch_failure`` says the replica never became ready and how: "crash" (the engine exited
    while loading, or the runtime could not start it; an exit with out-of-memory evidence makes it
    "oom") or "hang" (not ready within the start-up timeout). The recovery ladder counts those;
    the rest (no room at its turn, the queue timeout, an agent restart, a stop) are not the
    model's fault and leave it alone."""
    handle = handle or _handle(replica)
    tail = ""
    if handle is not None:
        runtime = runtime_for(handle.runtime)
        try:
            tail = runtime.logs(handle, lines=200)
            stopped = runtime.stop(handle, grace_seconds=10)
            exit = exit or stopped
        except Exception as error:  # keep failing the record even if the runtime misbehaves
            log.warning("cleaning up %s: %s", replica, error)
    with transaction.atomic():  # failed and given back together: nobody sees one without the other
        moved = states.move(replica, S.FAILED, message, log_tail=tail, exit_reason=message[:300])
        if moved:
            release(replica)
    if moved:
        if exit is not None and exit.out_of_memory:
            _record_oom(replica, exit)
        if launch_failure:
            _note_launch_failure(replica, "oom" if exit is not None and exit.out_of_memory else launch_failure,
                                 message)


def _note_launch_failure(replica: Replica, kind: str, message: str) -> None:
    """One step down the model's recovery ladder, when the deployment serves a catalog model (only
    those are placed by the policy; a deployment made by hand under another name is not counted)."""
    from serving.catalog.models import ModelEntry

    name = replica.deployment.name
    entry = ModelEntry.objects.filter(name=name).values("fingerprint", "fallbacks").first()
    if entry is None:
        return
    fallbacks = entry["fallbacks"] or ()
    known = set(ModelEntry.objects.filter(name__in=fallbacks).values_list("name", flat=True))
    recovery_service.note_failure(name, kind, message, entry["fingerprint"],
                                  fallback=bool(recovery.usable_fallbacks(name, fallbacks, known)))


def _calibrate(replica: Replica, peak: int | None) -> None:
    """Teach the estimator what this load really used (CPU: peak resident memory). Not a load with
    a draft model: its peak is two models', and calibration records are one model's."""
    deployment = replica.deployment
    if not peak or deployment.gpu_uuids or deployment.config.get("draft_model"):
        return
    try:
        shape = read_model(deployment.model_path)
        config = memory.engine_config(deployment.engine, estimation_config(deployment.engine, deployment.config))
        memory.record_load(shape, deployment.engine, _engine_version(replica), config, "cpu",
                           estimated_bytes=deployment.memory_reserved_bytes or peak, measured_bytes=peak,
                           node=replica.node)
    except BerthError as error:
        log.warning("no calibration record for %s: %s", replica, error.message)


def _engine_version(replica: Replica) -> str:
    """The node's engine version: calibration records are keyed by it, so loads and failures meet."""
    engine = replica.node.engines.filter(kind=replica.deployment.engine).first()
    return engine.version if engine else ""


def _record_oom(replica: Replica, exit: Exit) -> None:
    deployment = replica.deployment
    if deployment.config.get("draft_model"):
        return  # two models' memory: not evidence about either one's estimate (the ladder still counts it)
    try:
        shape = read_model(deployment.model_path)
        config = memory.engine_config(deployment.engine, estimation_config(deployment.engine, deployment.config,
                                                                           len(deployment.gpu_uuids)))
        source = "docker" if "docker" in (exit.oom_evidence or "").lower() else "kernel"
        memory.record_failure(shape, deployment.engine, _engine_version(replica), config,
                              "gpu" if deployment.gpu_uuids else "cpu",
                              estimated_bytes=deployment.memory_reserved_bytes or 1,
                              classification=ExitClassification("oom", exit.oom_evidence or "", source),
                              node=replica.node)
    except BerthError as error:
        log.warning("no OOM record for %s: %s", replica, error.message)


def stop_replica(replica_id: str) -> None:
    replica = _claim_stop(replica_id)
    if replica is None:
        return
    drain(replica, settings.SERVING_DRAIN_SECONDS)
    handle = _handle(replica)
    exit = runtime_for(handle.runtime).stop(handle) if handle else None
    with transaction.atomic():  # stopped and given back together: nobody sees one without the other
        if states.move(replica, S.STOPPED, "stopped" + (f" ({exit.describe()})" if exit else "")):
            release(replica)
    admit_next(replica.node_id)


def _claim_stop(replica_id: str) -> Replica | None:
    """Record the stop on the replica's row: cancelled at once when it has not started, else moved
    to ``stopping``. Each move is conditional on the state just read; when a start moved the replica
    meanwhile (say ``starting`` → ``loading``), it is read again and the stop tried again, so a stop
    is never lost to a start. Returns the replica whose engine this stop must now stop, or None
    (nothing runs, or the start in progress stops its own engine)."""
    while True:
        replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
        if replica is None or replica.state in states.TERMINAL:
            return None
        if replica.state in (S.PLANNED, S.QUEUED):
            with transaction.atomic():
                if states.move(replica, S.STOPPED, "cancelled before it started"):
                    release(replica)
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


def _base_url(replica: Replica) -> str:
    spec = launch_spec(replica)
    return f"http://{spec.host}:{spec.port}"


def sleep_replica(replica_id: str) -> None:
    """vLLM level-1 sleep: device memory is freed, so the replica's memory reservation is given back."""
    from serving.engines import vllm

    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is None or replica.state != S.READY:
        return
    try:
        vllm.sleep(_base_url(replica), replica_key(replica.public_id))
    except BerthError as error:  # stays ready, and says why it did not sleep
        DeploymentEvent.objects.create(deployment=replica.deployment, replica=replica, from_state=S.READY,
                                       to_state=S.READY, message=f"could not sleep: {error.message}")
        return
    if states.move(replica, S.SLEEPING, "asleep: its device memory is free"):
        memory.release_reservation(holder_of(replica))


def wake_replica(replica_id: str) -> None:
    """Claim the memory back under the node's lock, then wake; refused (and left asleep) when it is
    not free."""
    from serving.engines import vllm

    replica = Replica.objects.select_related("deployment", "node").filter(public_id=replica_id).first()
    if replica is None or replica.state != S.SLEEPING:
        return
    deployment = replica.deployment
    accelerators = accelerators_of(deployment)
    accelerator = accelerators[0] if accelerators else None
    try:
        memory.reserve_shards(replica.node, holder_of(replica), replica.memory_reserved_bytes, accelerators,
                              description=f"{deployment.name} (waking)")
        vllm.wake_up(_base_url(replica), replica_key(replica.public_id),
                     reservation_bytes=replica.memory_reserved_bytes,
                     free_device_bytes=lambda: _free_bytes(replica.node, accelerator))
    except BerthError as error:
        memory.release_reservation(holder_of(replica))
        DeploymentEvent.objects.create(deployment=deployment, replica=replica, from_state=S.SLEEPING,
                                       to_state=S.SLEEPING, message=f"wake refused: {error.message}")
        return
    states.move(replica, S.READY, "awake")


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
    """Give a free start-up slot to the next queued replica of the node."""
    from serving.deployments.service import dispatch

    busy = Replica.objects.filter(node_id=node_id, state__in=gate.BUSY).count()
    if busy >= settings.SERVING_STARTUP_SLOTS:
        return
    waiting = gate.next_in_line(node_id)
    if waiting is not None:
        dispatch("start", waiting)


def check_liveness(node: Node) -> None:
    """A replica that should be running whose engine exited or vanished moves to failed; a queued
    start that waited too long fails; a lost dispatch (agent restart) is sent again."""
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state__in=(S.READY, S.SLEEPING, S.UNKNOWN)):
        handle = _handle(replica)
        if handle is None:
            continue
        status = runtime_for(handle.runtime).status(handle)
        if not status.running:
            fail(replica, f"engine {status.exit.describe() if status.exit else 'vanished'}", handle=handle,
                 exit=status.exit)
    cutoff = timezone.now() - timezone.timedelta(seconds=settings.SERVING_QUEUE_TIMEOUT_SECONDS)
    for replica in Replica.objects.select_related("deployment", "node").filter(node=node, state=S.QUEUED,
                                                                                queued_at__lt=cutoff):
        fail(replica, f"waited more than {settings.SERVING_QUEUE_TIMEOUT_SECONDS // 60} min for a start-up slot")
    admit_next(node.pk)


def adopt(node: Node) -> None:
    """After an agent restart: loading engines whose process still runs are watched again; starts
    interrupted before their engine was up are failed, and stops interrupted are finished (what
    they held is given back, the engine is stopped); managed engines running without any record
    are adopted as ``unknown`` so a person sees and can stop them."""
    from serving import tasks

    managed = _managed()
    adopt_orphans(node, managed)
    # A start interrupted between launching its engine and recording the handle left that engine
    # running with no handle on the row: the runtime still finds it by the replica's id.
    launched = {handle.replica_id: handle for handle in managed}
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state__in=(S.STARTING, S.LOADING, S.STOPPING)):
        handle = _handle(replica) or launched.get(str(replica.public_id))
        if replica.state == S.STOPPING:
            exit = runtime_for(handle.runtime).stop(handle) if handle else None
            with transaction.atomic():
                if states.move(replica, S.STOPPED, "stopped once the agent restarted"
                               + (f" ({exit.describe()})" if exit else "")):
                    release(replica)
        elif replica.state == S.LOADING and handle is not None and runtime_for(handle.runtime).status(handle).running:
            tasks.watch_replica.apply_async(args=[str(replica.public_id)], queue=f"node.{node.name}")
        else:
            fail(replica, "the agent restarted before the engine was up", handle=handle)


def start_up() -> None:
    """Before the agent takes its first task: register the node and adopt what an earlier agent
    left (so a start it is about to receive is never mistaken for an interrupted one)."""
    from serving.services import register_local_node

    adopt(register_local_node())
    close_old_connections()


def _managed() -> list[Handle]:
    """Every managed engine running on this node, of either runtime."""
    handles = []
    for kind in ("process", "docker"):
        try:
            handles += runtime_for(kind).managed()
        except Exception as error:  # a runtime this node does not have (no Docker daemon): nothing of it runs
            log.info("no %s engines to adopt: %s", kind, error)
    return handles


def adopt_orphans(node: Node, handles: list[Handle]) -> list[Replica]:
    adopted = []
    known = {str(r) for r in Replica.objects.filter(public_id__in=[h.replica_id for h in handles if _is_id(h.replica_id)])
             .values_list("public_id", flat=True)}
    for handle in handles:
        if not _is_id(handle.replica_id) or handle.replica_id in known:
            continue
        name, port = _served_name_and_port(handle)
        if port is None:
            log.warning("a managed engine (%s) runs without a record and without a readable port", handle)
            continue
        with transaction.atomic():
            deployment = Deployment.objects.create(
                name=name or f"unknown-{handle.replica_id[:8]}", model_path="", node=node,
                runtime=handle.runtime, state=S.UNKNOWN,
                state_detail="found running without a record: adopted; stop it or leave it")
            adopted.append(Replica.objects.create(public_id=handle.replica_id, deployment=deployment, node=node,
                                                  port=port, state=S.UNKNOWN, handle=dataclasses.asdict(handle)))
            DeploymentEvent.objects.create(deployment=deployment, replica=adopted[-1], to_state=S.UNKNOWN,
                                           message="a managed engine found running without a record")
    return adopted


def _is_id(value: str) -> bool:
    import uuid

    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _served_name_and_port(handle: Handle) -> tuple[str, int | None]:
    """What the engine serves and where, from its own command line (the only record left)."""
    argv: list[str] = []
    if handle.runtime == "process" and handle.pid:
        try:
            argv = open(f"/proc/{handle.pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            return "", None
    elif handle.runtime == "docker" and handle.container_id:
        container = runtime_for("docker").client.containers.get(handle.container_id)
        argv = list(container.attrs.get("Args") or [])
    def after(flag):
        return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else ""
    port = after("--port")
    return after("--alias") or after("--served-model-name"), int(port) if port.isdigit() else None


def heartbeat_forever(stop: threading.Event) -> None:
    from serving.services import register_local_node

    while not stop.is_set():
        try:
            close_old_connections()
            node = register_local_node()
            check_liveness(node)
            watchdog.check(node)
        except Exception:  # a failed beat is logged and retried; it must not end the thread
            log.exception("agent heartbeat failed")
        stop.wait(settings.SERVING_HEARTBEAT_SECONDS)
