"""After an agent restart: what an earlier agent left on this node is taken over — engines still
loading are watched again, interrupted starts failed, interrupted stops finished, and managed
engines running without any record adopted as ``unknown`` so a person sees them.

A node back from lost (``take_back``). While its heartbeats were missing, the control loop failed
its replicas ("node … is lost", written on the row's ``exit_reason`` by ``serving.control.reconcile``)
and gave back what they held, but could not stop their engines. Whichever comes first — the agent
restarting (``adopt``) or the agent that never stopped beating again (``heartbeat.check_liveness``,
every beat) — the node reconciles each such replica with what it finds, once:

- its engine still runs and the replica was ready when the node was lost: it is **taken back** —
  ready again, the same engine (failed → ready, the one way back from failed), its memory
  reservation and contract share claimed again under the node's lock, as a placement would. It is
  refused instead, and its engine stopped, when a newer replica of the same name serves (the
  placement replaced it: two would be a duplicate), its port went to another replica, or its
  memory or contract share no longer fits;
- its engine still runs but the replica was not ready (loading, stopping, asleep, unknown): the
  engine is stopped; what should run is placed afresh;
- its engine no longer runs: nothing to take back.

Each refusal and each stop is the replica's failure again, with the reason (its ``exit_reason``
then no longer names the lost node, so it is settled once). At start-up, a managed engine still
running for a replica that ended for another reason is stopped too, and an event says so.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from django.db import transaction
from django.utils import timezone

from berth.errors import BerthError
from scheduler import memory
from scheduler.models import Node
from serving import queues
from serving.deployments import states
from serving.deployments.service import accelerators_of
from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica
from serving.models.states import HOLDING, SERVING, TERMINAL
from serving.node import failures
from serving.node.runtime import handle_of, runtime_for
from serving.runtimes.base import Handle
from tenancy.services import contracts

log = logging.getLogger(__name__)
# How ``serving.control.reconcile`` begins the reason it fails a lost node's replicas with (a
# sibling on this floor, so written here again; tests/serving/test_node_comeback.py holds them together).
LOST = "node {name} is lost (no heartbeat)"
TAKEN_BACK = "taken back: its node came back and its engine still runs (its memory and contract share claimed again)"


def adopt(node: Node) -> None:
    """After an agent restart: loading engines whose process still runs are watched again; starts
    interrupted before their engine was up are failed, and stops interrupted are finished (what
    they held is given back, the engine is stopped); managed engines running without any record
    are adopted as ``unknown`` so a person sees and can stop them; replicas failed while the node
    was lost are taken back or have their engines stopped (``take_back``), and an engine still
    running for a replica that ended otherwise is stopped."""
    managed = _managed()
    adopt_orphans(node, managed)
    _stop_engines_of_ended(node, managed)
    take_back(node, managed)
    # A start interrupted between launching its engine and recording the handle left that engine
    # running with no handle on the row: the runtime still finds it by the replica's id.
    launched = {handle.replica_id: handle for handle in managed}
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state__in=(S.STARTING, S.LOADING, S.STOPPING)):
        handle = handle_of(replica) or launched.get(str(replica.public_id))
        if replica.state == S.STOPPING:
            exit = runtime_for(handle.runtime).stop(handle) if handle else None
            states.move(replica, S.STOPPED, "stopped once the agent restarted" + (f" ({exit.describe()})" if exit else ""))
        elif replica.state == S.LOADING and handle is not None and runtime_for(handle.runtime).status(handle).running:
            queues.to_node("watch", replica)
        else:
            failures.fail(replica, "the agent restarted before the engine was up", handle=handle)


def take_back(node: Node, managed: list[Handle] | None = None) -> list[Replica]:
    """The node is back: its replicas failed because it was lost are taken back or have their
    engines stopped (the rule is the module's). ``managed``: the engines found running, when the
    caller listed them (start-up); the beat lists them only for a replica that has no handle (lost
    while its engine launched). Returns the replicas taken back."""
    found = {h.replica_id: h for h in managed} if managed is not None else None
    taken = []
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state=S.FAILED, exit_reason__startswith=LOST.format(name=node.name)):
        handle = handle_of(replica)
        if handle is None:
            found = found if found is not None else {h.replica_id: h for h in _managed()}
            handle = found.get(str(replica.public_id))
        status = runtime_for(handle.runtime).status(handle) if handle is not None else None
        if status is None or not status.running:
            ended = status.exit.describe() if status is not None and status.exit else "vanished"
            failures.fail(replica, f"its node came back; its engine no longer runs ({ended})", handle=handle)
            continue
        was = _state_when_lost(replica)
        if was != S.READY:
            failures.fail(replica, f"its node came back but its engine was stopped: the replica was {was or 'unknown'} "
                                   "when the node was lost, and only a ready one is taken back", handle=handle)
            continue
        refusal = _reclaim(replica, handle)
        if refusal is None:
            continue  # settled meanwhile by another pass of this rule
        if refusal:
            failures.fail(replica, f"its node came back but its engine was stopped: {refusal}", handle=handle)
        else:
            log.info("%s taken back: its engine still runs", replica)
            taken.append(replica)
    return taken


def _state_when_lost(replica: Replica) -> str:
    """What the replica was when its node was lost: the latest failure's origin."""
    return replica.events.filter(to_state=S.FAILED).order_by("-at", "-pk").values_list("from_state", flat=True).first()


class _Settled(Exception):
    """The row is no longer the one to take back: another pass of the rule moved it."""


def _reclaim(replica: Replica, handle: Handle) -> str | None:
    """Take the replica back (its memory and contract share claimed, failed → ready) under the
    node's lock, all or none. "" when taken back; the reason when refused; None when settled meanwhile."""
    deployment = replica.deployment
    try:
        with transaction.atomic():
            # The node's lock first, as a placement onto it takes: a launch there cannot slip in
            # between the duplicate check and the claim.
            node = Node.objects.select_for_update().get(pk=replica.node_id)
            replica.refresh_from_db()
            if replica.state != S.FAILED or not replica.exit_reason.startswith(LOST.format(name=node.name)):
                raise _Settled
            newer = Replica.objects.select_related("node").filter(
                deployment__name=deployment.name, state__in=SERVING, created_at__gt=replica.created_at) \
                .exclude(pk=replica.pk).first()
            if newer is not None:
                return (f"a newer replica of {deployment.name} ({newer.state} on {newer.node.name}) serves it now; "
                        "taking this one back would run a duplicate")
            if Replica.objects.filter(node=node, port=replica.port, state__in=HOLDING).exclude(pk=replica.pk).exists():
                return f"its port {replica.port} was given to another replica"
            accelerators = accelerators_of(deployment)
            if len(accelerators) != len(deployment.gpu_uuids):
                return "an accelerator it ran on is no longer on the node"
            if not replica.memory_reserved_bytes:
                return "it has no memory figure to reserve again"
            holder = states.holder_of(replica)
            memory.reserve_shards(node, holder, replica.memory_reserved_bytes, accelerators,
                                  description=f"{deployment.name} ({deployment.engine}), taken back")
            if deployment.owner is not None:  # the share a placement claims (``service.start``'s figures)
                gpus = len(accelerators)
                contracts.reserve(deployment.owner, holder, gpu_memory_gib=round(
                    replica.memory_reserved_bytes * gpus / memory.GIB, 2), gpus=gpus, cores=deployment.cores or 0)
            if not states.move(replica, S.READY, TAKEN_BACK, ready_at=replica.ready_at or timezone.now(),
                               stopped_at=None, exit_reason="", handle=dataclasses.asdict(handle)):
                raise _Settled
    except _Settled:
        return None
    except BerthError as error:  # no longer fits (memory, a contract): nothing was claimed
        return error.message
    return ""


def _stop_engines_of_ended(node: Node, managed: list[Handle]) -> None:
    """At start-up: a managed engine still running for a replica that ended (not through its node's
    loss: ``take_back`` had those) serves nobody and holds memory nothing accounts for: stopped."""
    running = {h.replica_id: h for h in managed if _is_id(h.replica_id)}
    for replica in Replica.objects.select_related("deployment").filter(
            node=node, public_id__in=list(running), state__in=TERMINAL) \
            .exclude(state=S.FAILED, exit_reason__startswith=LOST.format(name=node.name)):
        exit = runtime_for(running[str(replica.public_id)].runtime).stop(running[str(replica.public_id)])
        DeploymentEvent.objects.create(
            deployment=replica.deployment, replica=replica, from_state=replica.state, to_state=replica.state,
            message=f"its engine still ran after it had {replica.state}; stopped once the agent restarted"
                    + (f" ({exit.describe()})" if exit else ""))


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
