"""Serving's half of placement: the snapshot the placement policy decides on, and applying its plans.

The policy (``scheduler.policy``) is pure: it never reads Serving's tables. This module hands it
the catalog's models (profiles with their estimated size, scaling, class, owner) and the replicas
that run them, and applies what it returns: evictions first (stopping those replicas), then
launches (deploying a replica of the model on the chosen node). Deployments of names the catalog
does not know (deployed by hand, the demo) are passed as their memory reservations only: the
policy counts the memory they hold and never touches them. Every applied plan is recorded as
placement decisions (evidence). Applying a plan and scheduling again yields nothing new.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from collections import Counter
from typing import Mapping

from django.core.cache import cache
from django.db import transaction

from berth.errors import BerthError
from scheduler import placement_service, recovery_service
from scheduler.estimation.reading import read_model
from scheduler.models import Accelerator, Node
from scheduler.policy import plan as policy, recovery, scaling
from scheduler.policy.inputs import Hold, ReplicaInfo, Scaling, Snapshot
from scheduler.snapshot import contracts_from_tenancy, inventory, policy_settings, reservations_as_replicas
from serving import load
from serving.catalog import entries as catalog_entries, profiles, room, speed, transfer
from serving.deployments import actions, service, states
from serving.deployments.request import DeployRequest
from serving.models import DeploymentState as S, ModelEntry, Replica
from serving.models.states import COUNTING
from tenancy.audit import Actor

log = logging.getLogger(__name__)
ACTOR = Actor(system=service.PLACEMENT)
SCALE_KEY = "berth:placement:scale:"
HOLDS_KEY = "berth:placement:holds"
UNPLACEABLE_KEY = "berth:placement:unplaceable:"
LOCK_KEY, LOCK_S = "berth:placement:pass", 120  # a pass that dies keeps the lock this long at most


def _stamp(moment) -> float | None:
    return moment.timestamp() if moment else None


def _catalog() -> dict[str, ModelEntry]:
    return {e.name: e for e in ModelEntry.objects.select_related("owner")}


def deploy_request(entry: ModelEntry, node, *, profile: str | None = None, accelerator=None, another_replica=False,
                   level: int = 0, serves_as: str | None = None, waits_for: tuple[str, ...] = (), shards=()):
    """How one replica of a catalog model is deployed on ``node``: its profile's file and settings,
    the entry's task and owner. On-demand loads and the placement loop both deploy through this.

    ``level`` 1 is the recovery ladder's degraded relaunch after running out of memory or hanging
    (``profiles.degraded``); 2 its last rung for a model with no fallback, the minimal footprint
    (``profiles.minimal``): on the CPU of ``node`` where the engine can run there (the accelerator
    and shards the policy chose are left unused), with no draft model. ``serves_as`` deploys this
    entry under another model's name: the ladder's fallback to a smaller model, answering for the
    one that failed.
    ``waits_for`` names replicas stopped to make room: the new one starts once they have; ``shards``
    are a tensor-parallel replica's further accelerators (after ``accelerator``, on the same node)."""
    chosen = profiles.named(entry, profile) or {}
    kind, path = profiles.engine(chosen), catalog_entries.served_path(entry, chosen.get("name"))
    config = profiles.engine_config(chosen)
    if level >= recovery.MINIMAL_FOOTPRINT:
        if profiles.runs_on_cpu(kind):
            accelerator, shards = None, ()
        config = profiles.minimal(kind, config, read_model(path), on_gpu=accelerator is not None,
                                  shards=1 + len(shards))
    else:
        if entry.draft:
            config["draft_model"] = str(catalog_entries.draft_path(entry, kind))
        if level >= recovery.DEGRADED:
            config = profiles.degraded(kind, config, read_model(path), on_gpu=accelerator is not None,
                                       shards=1 + len(shards))
    node_path, transfers = transfer.plan(entry, node, path)  # the files its node lacks, fetched before it starts
    return DeployRequest(
        name=serves_as or entry.name, model_path=str(path), node=node,
        engine=kind, task=entry.task, config=config, accelerator=accelerator,
        owner=entry.owner, priority=int(chosen.get("priority") or 50), another_replica=another_replica,
        waits_for=tuple(waits_for), shards=tuple(shards), profile=chosen.get("name") or "",
        node_path=node_path, transfers=tuple(transfers))


def snapshot(waiting: Mapping[str, int] | None = None, *, batch_waiting: Mapping[str, int] | None = None,
             now: float | None = None, live: load.Load | None = None, step_scaling: bool = False,
             entries: Mapping[str, ModelEntry] | None = None) -> Snapshot:
    """The policy's inputs: the catalog's models, the replicas running them, what the gateway sees
    of load (requests in flight per replica: active replicas are never evicted; requests waiting
    for a model), when each model was last used (idle on-demand replicas go), the recovery
    ladder's memory, and the holds carried from the last plan. ``waiting`` adds requests a caller
    knows of (an on-demand load asking now), ``batch_waiting`` how many of those are at the batch
    priority: a model only batch requests wait for is placed where room is free, preempting nothing
    (``DesiredModel.waiting_batch_only``). The load-added replicas per model are read, and with
    ``step_scaling`` (the reconcile pass) moved one load-scaling step first. ``entries``: the
    catalog, when the caller has just read it."""
    now = time.time() if now is None else now
    live = live if live is not None else load.current(now)
    wanted = dict(live.waiting)
    for name, count in (waiting or {}).items():
        wanted[name] = max(wanted.get(name, 0), count)
    urgent = {name: count - live.waiting_batch.get(name, 0) for name, count in live.waiting.items()}
    for name, count in (waiting or {}).items():  # waiting above the batch priority
        urgent[name] = max(urgent.get(name, 0), count - (batch_waiting or {}).get(name, 0))
    entries = _catalog() if entries is None else entries
    rows = list(Replica.objects.select_related("deployment", "node")
                .filter(deployment__name__in=entries, state__in=PLACED).order_by("created_at", "pk"))
    used = load.last_used(entries, {r.deployment.name for r in rows}, now)
    extra = scale(now, live, entries.values(), rows, step=step_scaling)
    public_ids = dict(Accelerator.objects.values_list("uuid", "public_id"))
    models, speeds = [], speed.measured()
    for entry in entries.values():
        desired = room.desired_model(entry, speeds)
        if desired is None:
            continue  # nothing servable to place (no verified file, no estimate)
        models.append(dataclasses.replace(
            desired, scaling=Scaling(min=entry.scaling_min, max=max(entry.scaling_max, entry.scaling_min),
                                     idle_timeout_s=entry.idle_timeout_seconds or ModelEntry.DEFAULT_IDLE_SECONDS),
            fallbacks=tuple(entry.fallbacks or ()), pinned=entry.pinned, last_requested_at=used.get(entry.name),
            waiting=wanted.get(entry.name, 0), waiting_since=live.waiting_since.get(entry.name),
            waiting_batch_only=wanted.get(entry.name, 0) > 0 and urgent.get(entry.name, 0) <= 0,
            extra=extra.get(entry.name, 0), restart_before=_stamp(entry.restart_requested_at)))
    replicas, catalog_holders, counted = [], set(), Counter()
    for replica in rows:
        deployment = replica.deployment
        asleep = replica.state == S.SLEEPING
        counted[deployment.name] += 0 if asleep else 1  # oldest first: those beyond the base are the load-added ones
        catalog_holders.add(states.holder_of(replica))
        accelerators = tuple(str(public_ids[u]) for u in deployment.gpu_uuids if u in public_ids)
        in_flight = live.in_flight.get(str(replica.public_id), 0)
        replicas.append(ReplicaInfo(
            id=str(replica.public_id), model=deployment.name, profile=deployment.profile,
            node=replica.node.name, accelerators=accelerators, memory_bytes=replica.memory_reserved_bytes or 0,
            cpu_cores=deployment.cores or 0,
            # A sleeping replica whose wake was asked for claims its memory back: it is coming up.
            state="ready" if replica.state == S.READY else policy.ASLEEP if asleep and not replica.wake_requested_at
            else "starting",
            active_requests=in_flight, last_used_at=now if in_flight else used.get(deployment.name),
            ready_since=_stamp(replica.ready_at),
            load_seconds=(replica.ready_at - replica.started_at).total_seconds()
            if replica.ready_at and replica.started_at else None,
            created_at=replica.created_at.timestamp(), pinned=entries[deployment.name].pinned,
            load_added=counted[deployment.name] > max(entries[deployment.name].scaling_min, 1),
            sleep_host_bytes=sleep_host_bytes(deployment)))
    others = tuple(r for r in reservations_as_replicas() if r.id.removeprefix("reservation:") not in catalog_holders)
    return Snapshot(now=now, nodes=inventory(), models=tuple(models), replicas=tuple(replicas) + others,
                    contracts=contracts_from_tenancy(), failures=recovery_service.failure_states(),
                    holds=tuple(Hold(**h) for h in cache.get(HOLDS_KEY) or ()), settings=policy_settings())


# What the policy places and counts: replicas coming up or ready, and sleeping ones (their host memory).
PLACED = COUNTING + (S.SLEEPING,)


def sleep_host_bytes(deployment) -> int:
    """What the replica keeps in host memory asleep (vLLM's level-1 sleep moves its weights there);
    0 when it cannot sleep: not vLLM, or started without sleep mode."""
    if not actions.can_sleep(deployment):
        return 0
    return int((deployment.estimate or {}).get("weights_bytes") or 0)


def scale(now: float, live: load.Load, entries, rows, *, step: bool) -> dict[str, int]:
    """The load-added replicas per model whose maximum exceeds its base, after one load-scaling
    step each when ``step`` (each change logged with the load behind it); as they stand otherwise."""
    scalable = [e for e in entries if e.scaling_max > max(e.scaling_min, 1)]
    if not scalable:
        return {}
    states = cache.get_many([SCALE_KEY + e.name for e in scalable])
    extra = {}
    for entry in scalable:
        current = scaling.ScaleState(**states[SCALE_KEY + entry.name]) if SCALE_KEY + entry.name in states \
            else scaling.ScaleState()
        if step:
            mine = [r for r in rows if r.deployment.name == entry.name]
            ready = [str(r.public_id) for r in mine if r.state == S.READY]
            decision = scaling.step(current, scaling.Load(replicas=len(ready), running=live.running(ready),
                                                          waiting=live.waiting.get(entry.name, 0),
                                                          starting=len(mine) - len(ready)),
                                    base=max(entry.scaling_min, 1 if mine else 0), maximum=entry.scaling_max,
                                    now=now, max_concurrency=profiles.slots(profiles.first(entry)))
            if decision.change:
                log.info("load scaling %s: %s", entry.name, decision.reason)
            cache.set(SCALE_KEY + entry.name, dataclasses.asdict(decision.state), None)
            current = decision.state
        extra[entry.name] = current.extra
    return extra


def _log_unplaceable(plan, now: float) -> None:
    """One log line per model that cannot be placed, repeated only when its reason changes or every
    ten minutes (the pass runs every 15 s: the same sentence each time would drown the log)."""
    if not plan.unschedulable:
        return
    said = cache.get_many([UNPLACEABLE_KEY + u.model for u in plan.unschedulable])
    for u in plan.unschedulable:
        before = said.get(UNPLACEABLE_KEY + u.model) or {}
        if recovery.should_log(before.get("reason"), before.get("at"), u.reason, now):
            log.warning("cannot place %s (%s, %d missing): %s", u.model, u.code, u.missing, u.reason)
            cache.set(UNPLACEABLE_KEY + u.model, {"reason": u.reason, "at": now}, 3600)


def _unpark_changed(snap: Snapshot) -> None:
    """A parked model whose definition changed since is parked no more (the policy already places
    it): its recovery memory starts afresh, so the parked list stops showing it."""
    prints = {m.id: m.fingerprint for m in snap.models}
    for name, state in snap.failures.items():
        if state.parked and state.parked_fingerprint and prints.get(name) not in (None, "", state.parked_fingerprint):
            recovery_service.note_success(name)


def reconcile(waiting: Mapping[str, int] | None = None, *, batch_waiting: Mapping[str, int] | None = None,
              wait_s: float = 0) -> dict:
    """One pass: decide, record the evidence, apply. Returns what was done (for logs and tests).
    ``waiting`` and ``batch_waiting`` as for ``snapshot``.

    One pass at a time (the periodic one and on-demand loads both run it; two at once would both
    launch what is missing): a caller finding another pass under way waits up to ``wait_s``, then
    returns ``{"skipped": True}`` having done nothing."""
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"  # whose pass it is, for /readyz and doctor
    deadline = time.monotonic() + wait_s
    while not cache.add(LOCK_KEY, token, LOCK_S):
        if time.monotonic() >= deadline:
            return {"launched": [], "evicted": [], "unschedulable": {}, "skipped": True}
        time.sleep(0.1)
    try:
        return _reconcile(waiting, batch_waiting)
    finally:
        if cache.get(LOCK_KEY) == token:
            cache.delete(LOCK_KEY)


def _reconcile(waiting: Mapping[str, int] | None, batch_waiting: Mapping[str, int] | None) -> dict:
    now = time.time()
    live = load.current(now)
    entries = _catalog()
    snap = snapshot(waiting, batch_waiting=batch_waiting, now=now, live=live, step_scaling=True, entries=entries)
    _unpark_changed(snap)
    plan = policy.schedule(snap)
    cache.set(HOLDS_KEY, [dataclasses.asdict(h) for h in plan.holds], None)
    placement_service.note_moves(plan)
    unschedulable = {u.model: u.reason for u in plan.unschedulable}
    _log_unplaceable(plan, now)
    if plan.empty and not plan.unschedulable:
        return {"launched": [], "evicted": [], "unschedulable": unschedulable}
    placement_service.record_plan(snap, plan)
    evicted, launched = [], []
    for eviction in plan.evictions:
        replica = Replica.objects.select_related("deployment").filter(public_id=eviction.replica).first()
        if replica is None or replica.state not in PLACED:
            continue
        try:
            with transaction.atomic():
                if eviction.sleep:  # its device memory is freed all the same; a request wakes it in seconds
                    service.sleep(ACTOR, replica.deployment)
                else:
                    service.stop(ACTOR, replica.deployment)
                if eviction.beneficiary:
                    # Hand its reservation over now, so the beneficiary's launch below fits; that
                    # launch waits at the start-up gate until this engine has exited.
                    service.release(replica)
            evicted.append(replica.deployment.name)
        except BerthError as error:
            log.warning("could not evict %s (%s): %s", replica, eviction.reason, error.message)
    woken = []
    for wake in plan.wakes:
        replica = Replica.objects.select_related("deployment").filter(public_id=wake.replica, state=S.SLEEPING).first()
        if replica is None:
            continue  # woken or stopped since the snapshot
        try:
            service.wake(ACTOR, replica.deployment, wait_seconds=0)  # through the start-up gate; never waited on here
            woken.append(wake.model)
        except BerthError as error:
            log.warning("could not wake %s: %s", replica, error.message)
    for launch in plan.launches:  # the entries the snapshot was built from
        entry = entries.get(launch.serves_for or launch.model)
        node = Node.objects.filter(name=launch.node).first()
        if entry is None or node is None:
            continue
        found = {str(a.public_id): a for a in Accelerator.objects.filter(public_id__in=launch.accelerators)}
        accelerators = [found[a] for a in launch.accelerators if a in found]
        if len(accelerators) != len(launch.accelerators):
            continue  # an accelerator went away since the snapshot: the next pass sees it
        try:
            service.deploy(ACTOR, deploy_request(entry, node, profile=launch.profile or None,
                                                 accelerator=accelerators[0] if accelerators else None,
                                                 shards=accelerators[1:], another_replica=True, level=launch.level,
                                                 serves_as=launch.model if launch.serves_for else None,
                                                 waits_for=launch.beneficiary_of))
            launched.append(launch.model)
        except BerthError as error:  # the next pass sees why (the node changed since the snapshot)
            log.warning("could not launch %s on %s: %s", launch.model, node.name, error.message)
    done = {"launched": launched, "evicted": evicted, "unschedulable": unschedulable}
    return {**done, "woken": woken} if woken else done
