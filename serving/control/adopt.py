"""After an agent restart: what an earlier agent left on its node is taken over — engines still
loading are watched again, interrupted starts failed, interrupted stops finished, and managed
engines running without any record adopted as ``unknown`` so a person sees them. The agent's first
heartbeat says which engines run there (``seen``); what must be stopped is asked of it as jobs.

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
from serving.control import failures, node_work
from serving.deployments import states, stopping
from serving.deployments.states import accelerators_of
from serving.models import Deployment, DeploymentEvent, DeploymentState as S, Replica
from serving.models.states import HOLDING, SERVING, TERMINAL
from serving.runtimes.base import EngineSeen, Handle
from tenancy.services import contracts

log = logging.getLogger(__name__)
# How ``serving.control.reconcile`` begins the reason it fails a lost node's replicas with (a
# sibling on this floor, so written here again; tests/serving/test_node_comeback.py holds them together).
LOST = "node {name} is lost (no heartbeat)"
TAKEN_BACK = "taken back: its node came back and its engine still runs (its memory and contract share claimed again)"


def adopt(node: Node, seen: dict[str, EngineSeen]) -> None:
    """After an agent restart (``seen``: the managed engines it found, by replica id): loading
    engines that still run are watched again; starts interrupted before their engine was up are
    failed, and stops interrupted are finished (what they held is given back, the engine is
    stopped); managed engines running without any record are adopted as ``unknown`` so a person
    sees and can stop them; replicas failed while the node was lost are taken back or have their
    engines stopped (``take_back``), and an engine still running for a replica that ended otherwise
    is stopped."""
    running = {replica_id: engine for replica_id, engine in seen.items() if engine.running}
    adopt_orphans(node, list(running.values()))
    _stop_engines_of_ended(node, running)
    take_back(node, seen)
    # A start interrupted between launching its engine and recording the handle left that engine
    # running with no handle on the row: the runtime still finds it by the replica's id.
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state__in=(S.STARTING, S.LOADING, S.STOPPING)):
        engine = seen.get(str(replica.public_id))
        handle = engine.handle if engine is not None and engine.running else None
        if replica.state == S.STOPPING:
            if handle is not None:
                stopping.stop_engine(replica, handle, {"state": S.STOPPED,
                                                       "message": "stopped once the agent restarted"})
            else:
                states.move(replica, S.STOPPED, "stopped once the agent restarted")
        elif replica.state == S.LOADING and handle is not None:
            queues.to_node(node_work.WATCH, replica)
        else:
            _fail(replica, "the agent restarted before the engine was up", engine)


def take_back(node: Node, seen: dict[str, EngineSeen]) -> list[Replica]:
    """The node is back: its replicas failed because it was lost are taken back or have their
    engines stopped (the rule is the module's). ``seen``: the engines the node reported, by replica
    id; a replica whose engine it did not report is left for a beat that does. Returns the
    replicas taken back."""
    taken = []
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, state=S.FAILED, exit_reason__startswith=LOST.format(name=node.name)):
        engine = seen.get(str(replica.public_id))
        if engine is None and replica.handle:
            continue  # not reported this beat: the next one says
        if stopping.stopping(replica):
            continue  # its engine is being stopped already: settled once that job ends
        if engine is None or not engine.running:
            ended = engine.exit.describe() if engine is not None and engine.exit else "vanished"
            _fail(replica, f"its node came back; its engine no longer runs ({ended})", engine)
            continue
        was = _state_when_lost(replica)
        if was != S.READY:
            _fail(replica, f"its node came back but its engine was stopped: the replica was {was or 'unknown'} "
                           "when the node was lost, and only a ready one is taken back", engine)
            continue
        refusal = _reclaim(replica, engine.handle)
        if refusal is None:
            continue  # settled meanwhile by another pass of this rule
        if refusal:
            _fail(replica, f"its node came back but its engine was stopped: {refusal}", engine)
        else:
            log.info("%s taken back: its engine still runs", replica)
            taken.append(replica)
    return taken


def _fail(replica: Replica, message: str, engine: EngineSeen | None) -> None:
    """The replica's failure: its engine (still running) stopped by the node first, its log tail kept."""
    if engine is not None and engine.running:
        node_work.fail(replica, message, handle=engine.handle)
    else:
        failures.record(replica, message, log_tail=engine.log_tail if engine else "",
                        exit=engine.exit if engine else None)


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


def _stop_engines_of_ended(node: Node, running: dict[str, EngineSeen]) -> None:
    """At start-up: a managed engine still running for a replica that ended (not through its node's
    loss: ``take_back`` has those) serves nobody and holds memory nothing accounts for: stopped."""
    for replica in Replica.objects.select_related("deployment", "node").filter(
            node=node, public_id__in=[r for r in running if _is_id(r)], state__in=TERMINAL) \
            .exclude(state=S.FAILED, exit_reason__startswith=LOST.format(name=node.name)):
        stopping.stop_engine(replica, running[str(replica.public_id)].handle, {
            "state": "", "message": f"its engine still ran after it had {replica.state}; stopped once the agent "
                                    "restarted"})


def adopt_orphans(node: Node, engines: list[EngineSeen]) -> list[Replica]:
    adopted = []
    known = {str(r) for r in Replica.objects.filter(public_id__in=[e.handle.replica_id for e in engines
                                                                   if _is_id(e.handle.replica_id)])
             .values_list("public_id", flat=True)}
    for engine in engines:
        handle = engine.handle
        if not _is_id(handle.replica_id) or handle.replica_id in known:
            continue
        if engine.port is None:
            log.warning("a managed engine (%s) runs without a record and without a readable port", handle)
            continue
        with transaction.atomic():
            deployment = Deployment.objects.create(
                name=engine.served_name or f"unknown-{handle.replica_id[:8]}", model_path="", node=node,
                runtime=handle.runtime, state=S.UNKNOWN,
                state_detail="found running without a record: adopted; stop it or leave it")
            adopted.append(Replica.objects.create(public_id=handle.replica_id, deployment=deployment, node=node,
                                                  port=engine.port, state=S.UNKNOWN, handle=dataclasses.asdict(handle)))
            DeploymentEvent.objects.create(deployment=deployment, replica=adopted[-1], to_state=S.UNKNOWN,
                                           message="a managed engine found running without a record")
    return adopted


def _is_id(value: str) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True
