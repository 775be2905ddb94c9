"""Serving's half of placement: the snapshot Scheduler II decides on, and applying its plans.

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
import time

from berth.errors import BerthError
from scheduler import placement_service
from scheduler.models import Accelerator, Node
from scheduler.policy import plan as policy
from scheduler.policy.inputs import ReplicaInfo, Scaling, Snapshot
from scheduler.snapshot import contracts_from_tenancy, inventory, reservations_as_replicas
from serving import ondemand
from serving.catalog import room
from serving.catalog.entries import deploy_request
from serving.catalog.models import ModelEntry
from serving.deployments import service
from serving.models import DeploymentState as S, Replica
from tenancy.audit import Actor

log = logging.getLogger(__name__)
ACTOR = Actor(system="placement")
COUNTING = (S.PLANNED, S.QUEUED, S.STARTING, S.LOADING, S.READY)


def _stamp(moment) -> float | None:
    return moment.timestamp() if moment else None


def snapshot() -> Snapshot:
    entries = {e.name: e for e in ModelEntry.objects.select_related("owner")}
    # Idle on-demand replicas are unloaded by ``serving.ondemand`` (from the gateway's last-use
    # notes): the policy is not told when models were used, so it never also unloads them as idle.
    models = []
    for entry in entries.values():
        desired = room.desired_model(entry)
        if desired is None:
            continue  # nothing servable to place (no verified file, no estimate)
        models.append(dataclasses.replace(
            desired, scaling=Scaling(min=entry.scaling_min, max=max(entry.scaling_max, entry.scaling_min),
                                     idle_timeout_s=entry.idle_timeout_seconds or ondemand.DEFAULT_IDLE_SECONDS),
            fallbacks=tuple(entry.fallbacks or ())))
    replicas, catalog_holders = [], set()
    for replica in (Replica.objects.select_related("deployment", "node")
                    .filter(deployment__name__in=entries, state__in=COUNTING)):
        deployment = replica.deployment
        catalog_holders.add(service.holder_of(replica))
        accelerators = tuple(str(a) for a in Accelerator.objects.filter(uuid__in=deployment.gpu_uuids)
                             .values_list("public_id", flat=True))
        replicas.append(ReplicaInfo(
            id=str(replica.public_id), model=deployment.name, profile=deployment.config.get("profile", ""),
            node=replica.node.name, accelerators=accelerators, memory_bytes=replica.memory_reserved_bytes or 0,
            cpu_cores=deployment.cores or 0, state="ready" if replica.state == S.READY else "starting",
            ready_since=_stamp(replica.ready_at),
            load_seconds=(replica.ready_at - replica.started_at).total_seconds()
            if replica.ready_at and replica.started_at else None,
            created_at=replica.created_at.timestamp()))
    others = tuple(r for r in reservations_as_replicas() if r.id.removeprefix("reservation:") not in catalog_holders)
    return Snapshot(now=time.time(), nodes=inventory(), models=tuple(models), replicas=tuple(replicas) + others,
                    contracts=contracts_from_tenancy())


def reconcile() -> dict:
    """One pass: decide, record the evidence, apply. Returns what was done (for logs and tests)."""
    snap = snapshot()
    plan = policy.schedule(snap)
    if plan.empty and not plan.unschedulable:
        return {"launched": [], "evicted": []}
    placement_service.record_plan(snap, plan)
    evicted, launched = [], []
    for eviction in plan.evictions:
        replica = Replica.objects.select_related("deployment").filter(public_id=eviction.replica).first()
        if replica is None or replica.state not in COUNTING:
            continue
        try:
            service.stop(ACTOR, replica.deployment)
            evicted.append(replica.deployment.name)
        except BerthError as error:
            log.warning("could not evict %s (%s): %s", replica, eviction.reason, error.message)
    entries = {e.name: e for e in ModelEntry.objects.select_related("owner")}
    for launch in plan.launches:
        entry = entries.get(launch.model)
        node = Node.objects.filter(name=launch.node).first()
        if entry is None or node is None:
            continue
        accelerator = Accelerator.objects.filter(public_id__in=launch.accelerators).first() \
            if launch.accelerators else None
        try:
            service.deploy(ACTOR, deploy_request(entry, node, profile=launch.profile or None, accelerator=accelerator,
                                                 another_replica=True))
            launched.append(entry.name)
        except BerthError as error:  # the next pass sees why (the node changed since the snapshot)
            log.warning("could not launch %s on %s: %s", entry.name, node.name, error.message)
    return {"launched": launched, "evicted": evicted}
