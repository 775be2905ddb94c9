"""Where a held model runs, and the room for more of it.

The room for more is the placement policy's headroom (``scheduler.placement_service.headroom``): the
catalog entry becomes the policy's :class:`~scheduler.policy.inputs.DesiredModel` and is dry-run
against the current snapshot (the inventory, with every memory reservation — Berth's replicas
included — as a pinned stand-in). Where the policy cannot be asked, the fit planner is asked per
node instead (``scheduler.memory.estimate_and_fit``: the node's free memory for new work divided
by the estimate). The same figure refuses a minimum the fleet cannot hold.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Mapping

from berth.errors import BerthError
from scheduler import memory, placement_service
from scheduler.models import Node
from scheduler.placement_service import parked_and_unplaceable
from scheduler.policy.inputs import DesiredModel, Draft, Profile, Scaling
from scheduler.snapshot import current_snapshot
from serving.catalog import entries, profiles, servability, speed
from serving.catalog.errors import ScalingRefused
from serving.models import ModelEntry
from serving.models.states import COMING_UP, LOADABLE, TERMINAL, UP
from tenancy.audit import SYSTEM

log = logging.getLogger(__name__)

# Replica states that count as running (or about to): they hold a port and memory.
HEADROOM_LIMIT = 16


@dataclasses.dataclass
class Room:
    """How many more replicas fit, where (node → count), what stopped the count, and how it was known."""

    more: int | None  # None: not known (no estimate, or nothing to ask)
    nodes: dict[str, int] = dataclasses.field(default_factory=dict)
    blocked: str = ""
    source: str = ""  # "headroom" or "fit planner"; "" when not known
    per_replica_bytes: int | None = None
    note: str = ""

    @property
    def where(self) -> str:
        return ", ".join(f"{count} on {node}" for node, count in sorted(self.nodes.items()))


# --- where it runs ----------------------------------------------------------------------------

def live_replicas(entry: ModelEntry) -> list:
    """The entry's replicas that run or are starting (``entry.deployments`` from ``held_entries``)."""
    return [r for d in getattr(entry, "deployments", []) for r in d.replica_set.all() if r.state in LOADABLE]


def placement(entry: ModelEntry, verdicts: dict | None = None) -> dict:
    """Ready of wanted, starting, nodes and the state word (serving / starting / parked /
    unplaceable / idle / stopped) of one held model."""
    replicas = live_replicas(entry)
    ready = sum(r.state in UP for r in replicas)
    starting = sum(r.state in COMING_UP for r in replicas)
    active = [d for d in getattr(entry, "deployments", []) if d.state not in TERMINAL]
    wanted = max(entry.scaling_min, sum(d.replicas for d in active))
    nodes = sorted({r.node.name for r in replicas})
    verdict = (verdicts or {}).get(entry.name) or (verdicts or {}).get(str(entry.public_id))
    if verdict is not None and ready < max(wanted, 1):
        state, reason = verdict["state"], verdict.get("detail", "")
    elif ready:
        state, reason = "serving", ""
    elif starting:
        state, reason = "starting", ""
    elif entry.scaling_min == 0:
        state, reason = "idle", "on demand: no replica until a request asks for it"
    else:
        state, reason = "stopped", f"wants {entry.scaling_min} and none runs"
    return {"ready": ready, "wanted": wanted, "starting": starting, "nodes": nodes, "state": state, "reason": reason}


def placement_verdicts() -> dict[str, dict]:
    """The latest parked or unschedulable verdict per model, from the placement policy's evidence rows: every
    model's (read as Berth itself); callers show them only beside the entries the reader sees."""
    try:
        found = parked_and_unplaceable(SYSTEM)
    except BerthError as error:  # the placement evidence cannot be read now: no verdicts
        log.warning("placement verdicts unavailable: %s", error)
        return {}
    verdicts = {}
    for state, rows in (("unplaceable", found.get("unplaceable", [])), ("parked", found.get("parked", []))):
        for row in rows:
            verdicts[row["model"]] = {"state": state, "detail": row.get("detail") or ""}
    return verdicts


# --- the room for more ------------------------------------------------------------------------

def _profile_bytes(entry: ModelEntry, profile: dict) -> int | None:
    if profile.get("memory_bytes"):
        return int(profile["memory_bytes"])
    try:
        path = entries.served_path(entry, profile.get("name"))
    except BerthError:
        return None
    verdict = servability.check(path, profile=profile)
    if not verdict.servable or not verdict.estimate:
        return None
    return int(verdict.estimate["total_bytes"])


def desired_model(entry: ModelEntry, speeds: Mapping[tuple[str, str], float] | None = None):
    """The entry as the policy's model, wanting no replica of its own (so the dry run counts only
    what comes on top of what already runs: running replicas are in the snapshot as reservations).
    ``speeds``: measured tokens/s per (model, profile), read for this entry when not given."""
    speeds = speed.measured([entry.name]) if speeds is None else speeds

    ways, servable, minimal = [], [], []
    for index, p in enumerate(entry.profiles or []):
        size = _profile_bytes(entry, p)
        if size is None:
            continue
        servable.append(p)
        engine = profiles.engine(p)
        gpus = profiles.gpus(p, engine)
        name = p.get("name") or f"profile-{index}"
        ways.append(Profile(name=name, engine=engine, gpus=gpus, memory_bytes=size, cpu_cores=int(p.get("cores") or 0),
                            priority=int(p.get("priority") or 0), tokens_per_s=speeds.get((entry.name, name))))
        if gpus and profiles.runs_on_cpu(engine):
            # The last rung runs it on the CPU: its weights move to host memory. Sized as the GPU
            # replica's whole footprint (the minimal context and one slot take less): an upper bound.
            minimal.append(dataclasses.replace(ways[-1], gpus=0, memory_bytes=size * gpus, tokens_per_s=None))
        else:
            minimal.append(ways[-1])
    if not ways:
        return None
    draft = None
    if entry.draft:
        added = _draft_bytes(entry, servable[0])  # the policy holds one draft figure per model
        if added is None:
            return None  # what it must load beside it cannot be served: it cannot be placed either
        draft = Draft(entry.draft, added)
    model = DesiredModel(entry.name, tuple(ways), Scaling(min=0, max=entry.scaling_max),
                         capacity_class=entry.service_class, owner=entry.owner.path if entry.owner else "",
                         fingerprint=entry.fingerprint, draft=draft, minimal=tuple(minimal))
    # The profiles' placement constraints (class, labels, disk, MIG) and the weights key: the
    # placement pass and the headroom dry run filter alike.
    return profiles.constrained(model, entry)


def _draft_bytes(entry: ModelEntry, profile: dict) -> int | None:
    """What the entry's draft model adds to one replica of ``profile`` (the same engine, context and
    slots), or None when the draft cannot be served."""
    engine = profiles.engine(profile)
    try:
        config = memory.engine_config(engine, profiles.estimate_config(profile))
        draft, _ = memory.draft_estimate(entries.draft_path(entry, engine), engine, config, check_root=False)
    except BerthError as error:
        log.warning("%s cannot be placed with its draft: %s", entry.name, error.message)
        return None
    return memory.draft_bytes(draft)


def room_for_more(entry: ModelEntry, *, record: bool = False) -> Room:
    """The placement policy's headroom for the entry; the fit planner per node where that cannot be asked."""
    model = desired_model(entry)
    if model is None:
        return Room(more=None, note="No memory estimate: the model has no verified, servable file.")
    per_replica = max(p.footprint() for p in model.profiles)
    try:
        answer = placement_service.headroom(current_snapshot((model,)), model.id, limit=HEADROOM_LIMIT,
                                            record=record)
    except BerthError as error:
        log.warning("headroom unavailable for %s, asking the fit planner: %s", entry.name, error)
        return fit_per_node(entry, per_replica)
    return Room(more=int(answer.get("more") or 0), nodes=dict(Counter(answer.get("nodes") or [])),
                blocked=answer.get("blocked") or "", source="headroom", per_replica_bytes=per_replica)


def fit_per_node(entry: ModelEntry, per_replica: int | None = None) -> Room:
    """The fit planner's answer, node by node: free memory for new work over one replica's estimate."""
    profile = profiles.first(entry)
    if not profile:
        return Room(more=None, note="The model has no profile.")
    try:
        path = Path(entries.served_path(entry, profile.get("name")))
    except BerthError as error:
        return Room(more=None, note=error.message)
    engine = profiles.engine(profile)
    nodes, reasons = {}, []
    for node in Node.objects.prefetch_related("engines").order_by("name"):
        if node.state != "ready":
            reasons.append(f"{node.name} is {node.state}")
            continue
        try:
            result = memory.estimate_and_fit(path, engine, profiles.estimate_config(profile), node=node,
                                             check_root=False)
        except BerthError as error:
            reasons.append(f"{node.name}: {error.message}")
            continue
        if result.fit is None:
            reasons.append(f"{node.name}: memory never measured")
            continue
        size = per_replica or result.estimate.total_bytes
        count = max(0, result.fit.free_for_new_bytes) // size if size else 0
        if count:
            nodes[node.name] = int(min(count, HEADROOM_LIMIT))
        else:
            reasons.append(f"{node.name} has {max(0, result.fit.free_for_new_bytes):,} bytes free for new work, "
                           f"one replica needs {size:,}")
    return Room(more=sum(nodes.values()), nodes=nodes, blocked="; ".join(reasons) or "",
                source="fit planner", per_replica_bytes=per_replica)


def check_scaling(entry: ModelEntry, low: int, high: int, *, room: Room | None = None) -> Room | None:
    """Refuse a minimum placement cannot meet: what runs now plus the room for more must reach it.
    A minimum no higher than what runs (or than before) needs no room. ``max ≥ min`` is the
    validation's (every problem listed)."""
    running = len(live_replicas(entry))
    if low <= max(running, entry.scaling_min) or high < low:
        return room
    room = room or room_for_more(entry, record=True)
    if room.more is None:
        return room  # not known: the reconcile loop will say when it cannot place it
    can = running + room.more
    if low > can:
        where = f" ({room.where})" if room.nodes else ""
        raise ScalingRefused(
            f"{entry.name}: at least {low} cannot be met — {running} run{'s' if running == 1 else ''} and "
            f"{room.more} more fit{where}, {can} in all" + (f": {room.blocked}" if room.blocked else "") + ".",
            details={"minimum": low, "running": running, "more": room.more, "nodes": room.nodes,
                     "blocked": room.blocked, "source": room.source})
    return room
