"""The fleet at a glance, for ``manage.py status`` and ``GET /api/serving/status/`` (the console's
dashboard): one function, :func:`summary`, reads the same rows the console's tables do and returns
plain data narrowed to what the caller may see.

* ``capacity`` — per accelerator class, the placeable units (GPUs, or MIG instances of a card in MIG
  mode) and how many hold a memory reservation: the fleet's, shown to every caller, with no tenant's
  names in it; ``free_nodes`` — ready nodes with accelerators none of which is held.
* ``memory`` — per node, its memory per accelerator class and its system memory: total, reserved
  (Berth's reservations), measured (what the devices report in use; null when any is not read) and
  free (total less the larger of the two). The fleet's too, with no holder named.
* ``models`` — every catalog entry the caller may see, as the catalog's pages place it
  (``catalog.queries.held_entries`` → ``catalog.room.placement``): ready of wanted, and satisfied
  when it has what it should have now. Parked never counts as satisfied, whatever runs.
* ``parked`` / ``unplaceable`` — among those, with why (the placement verdicts: the recovery
  memory and the latest plan).
* ``idle_replicas`` — ready or sleeping replicas of those models that nobody used in a day
  (``serving.load.last_used``; a model whose last use is not known is not idle).
* ``watchdog`` — the memory level per node, as the caller's ``levels`` reads it (the watchdog keeps
  them at each heartbeat; the transports pass ``serving.control.watchdog.levels``).
* ``deployments`` — the deployments the caller may see, counted by state (a deployment that runs a
  file under its own name is not a catalog model, and still runs).
* ``failures`` — the latest deployment events to ``failed`` in the last 24 hours, of deployments
  the caller may see; ``failures_count`` — how many there were in all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, OuterRef, Prefetch, Subquery, Sum

from scheduler.models import Accelerator, MemoryReservation, Node
from serving import load
from serving.catalog import queries, room
from serving.models import Deployment, DeploymentEvent, DeploymentState
from serving.models.states import UP
from tenancy import access

IDLE_AFTER_S = 24 * 3600
FAILURES_SINCE = timedelta(hours=24)
FAILURES_LIMIT = 5
UNCLASSED = "(no class)"


def summary(caller: Any, *, levels: Callable | None = None, now: float | None = None) -> dict:
    """Every figure the status shows, as plain data (JSON as it stands) for ``caller``.
    ``levels``: nodes → {node name: level} or None when not known (``serving.control.watchdog.levels``)."""
    now = time.time() if now is None else now
    # What the node itself holds (replicas on its CPU), summed in the nodes' own query.
    system_reserved = (MemoryReservation.objects.filter(node=OuterRef("pk"), accelerator__isnull=True).order_by()
                       .values("node").annotate(total=Sum("bytes")).values("total"))
    accelerators = Accelerator.objects.prefetch_related("reservations")
    nodes = list(Node.objects.order_by("name").annotate(system_reserved_bytes=Subquery(system_reserved))
                 .prefetch_related(Prefetch("accelerators", queryset=accelerators)))
    models = _models(caller, now)
    return {
        "capacity": _capacity(nodes),
        "free_nodes": _free_nodes(nodes),
        "nodes": _nodes(nodes, levels),
        "memory": _memory(nodes),
        **models,
        "deployments": _deployments(caller),
        **_failures(caller, now),
    }


# --- the fleet ---------------------------------------------------------------------------------

def _units(node: Node) -> list:
    """The units a replica is placed on: a card in MIG mode counts through its instances."""
    return [a for a in node.accelerators.all() if not (a.kind == Accelerator.Kind.GPU and a.mig_enabled)]


def _held(unit) -> bool:
    return bool(unit.reservations.all())  # prefetched: no query


def _capacity(nodes: list) -> list[dict]:
    classes: dict[str, dict] = {}
    for node in nodes:
        for unit in _units(node):
            row = classes.setdefault(unit.accelerator_class or UNCLASSED, {
                "accelerator_class": unit.accelerator_class or UNCLASSED, "total": 0, "in_use": 0, "free": 0,
                "unavailable": 0, "memory_total_bytes": 0, "memory_reserved_bytes": 0})
            row["total"] += 1
            held = _held(unit)
            if held:
                row["in_use"] += 1
            elif node.state == Node.State.READY and unit.placeable and unit.healthy is not False:
                row["free"] += 1
            else:
                row["unavailable"] += 1
            row["memory_total_bytes"] += unit.memory_total_bytes or 0
            row["memory_reserved_bytes"] += sum(r.bytes for r in unit.reservations.all())
    for row in classes.values():
        row["used_percent"] = round(row["in_use"] * 100 / row["total"], 1) if row["total"] else 0.0
    return [classes[name] for name in sorted(classes)]


def _free_nodes(nodes: list) -> list[str]:
    """Ready nodes with accelerators, none of them held: a whole node for a model that needs one."""
    return [node.name for node in nodes
            if node.state == Node.State.READY and _units(node) and not any(_held(u) for u in _units(node))]


def _memory_row(kind: str, device: str, units: int, total: int, reserved: int, measured: int | None) -> dict:
    # Free is what neither Berth's reservations nor the devices' own reading claim; a reading not
    # taken is not zero use, so free then rests on the reservations alone.
    claimed = reserved if measured is None else max(reserved, measured)
    return {"kind": kind, "device": device, "units": units, "total_bytes": total, "reserved_bytes": reserved,
            "measured_bytes": measured, "free_bytes": max(0, total - claimed)}


def _memory(nodes: list) -> list[dict]:
    out = []
    for node in nodes:
        classes: dict[str, list] = {}
        for unit in _units(node):
            classes.setdefault(unit.accelerator_class or UNCLASSED, []).append(unit)
        rows = []
        for name in sorted(classes):
            units = classes[name]
            used = [u.memory_used_bytes for u in units]
            rows.append(_memory_row("accelerator", name, len(units), sum(u.memory_total_bytes or 0 for u in units),
                                    sum(r.bytes for u in units for r in u.reservations.all()),
                                    None if None in used else sum(used)))
        if node.memory_total_bytes:
            total, available = node.memory_total_bytes, node.memory_available_bytes
            rows.append(_memory_row("system", "system memory", 0, total, node.system_reserved_bytes or 0,
                                    None if available is None else max(0, total - available)))
        out.append({"node": node.name, "node_id": str(node.public_id), "state": node.state, "memory": rows})
    return out


def _nodes(nodes: list, levels: Callable | None) -> list[dict]:
    known = levels(nodes) if levels is not None else None
    return [{"name": node.name, "state": node.state,
             "watchdog": None if known is None else known.get(node.name)} for node in nodes]


# --- the caller's models -----------------------------------------------------------------------

def _models(caller: Any, now: float) -> dict:
    # Placed as the catalog's pages place them (``queries.held``), with the verdicts read once here.
    entries = queries.held_entries(caller, verdicts=False)
    verdicts = room.placement_verdicts() if entries else {}
    rows, parked, unplaceable = [], [], []
    for entry in sorted(entries, key=lambda e: e.name):
        place = entry.placement = room.placement(entry, verdicts)
        verdict = verdicts.get(entry.name) or verdicts.get(str(entry.public_id)) or {}  # as placement() looks
        is_parked = verdict.get("state") == "parked"
        satisfied = not is_parked and place["state"] not in ("parked", "unplaceable") \
            and place["ready"] >= place["wanted"]
        rows.append({"name": entry.name, "public_id": str(entry.public_id),
                     "owner": entry.owner.path if entry.owner else None,
                     "ready": place["ready"], "wanted": place["wanted"], "starting": place["starting"],
                     "state": "parked" if is_parked else place["state"],
                     "reason": verdict.get("detail", "") if is_parked else place["reason"],
                     "satisfied": satisfied, "nodes": place["nodes"]})
        if is_parked:
            parked.append({"name": entry.name, "reason": verdict.get("detail", "")})
        elif place["state"] == "unplaceable":  # as the table says: a verdict it has outgrown is not shown
            unplaceable.append({"name": entry.name, "reason": place["reason"]})
    return {"models": rows,
            "satisfied": {"satisfied": sum(r["satisfied"] for r in rows), "total": len(rows)},
            "parked": parked, "unplaceable": unplaceable, "idle_replicas": _idle(entries, now)}


def _idle(entries: list, now: float) -> list[dict]:
    """Ready or sleeping replicas, up for a day, of models nobody asked for in a day. Read only:
    ``running`` is empty so that a model not known here is not given a use it never had."""
    up = [(entry, r) for entry in entries for d in entry.deployments for r in d.replica_set.all() if r.state in UP]
    used = load.last_used([entry.name for entry, _ in up], (), now=now) if up else {}
    idle = []
    for entry, replica in up:
        last = used.get(entry.name)
        since = replica.ready_at.timestamp() if replica.ready_at else None
        if last is None or now - last < IDLE_AFTER_S or since is None or now - since < IDLE_AFTER_S:
            continue
        idle.append({"model": entry.name, "replica": str(replica.public_id), "node": replica.node.name,
                     "state": replica.state, "idle_seconds": int(now - last)})
    return sorted(idle, key=lambda r: (-r["idle_seconds"], r["model"]))


def _deployments(caller: Any) -> dict[str, int]:
    counted = access.visible_owned(caller, Deployment.objects.all()).order_by().values("state").annotate(n=Count("id"))
    return {row["state"]: row["n"] for row in counted}


def _failures(caller: Any, now: float) -> dict:
    since = datetime.fromtimestamp(now, tz=UTC) - FAILURES_SINCE
    events = access.visible_owned(caller, DeploymentEvent.objects.filter(to_state=DeploymentState.FAILED, at__gte=since)
                                  .select_related("deployment__node"), "deployment__owner")
    latest = [{"deployment": e.deployment.name, "deployment_id": str(e.deployment.public_id),
               "node": e.deployment.node.name, "at": e.at.isoformat(), "from_state": e.from_state,
               "message": e.message} for e in events.order_by("-at", "-id")[:FAILURES_LIMIT]]
    # All of the day's, counted only when the latest do not already say how many there are.
    count = len(latest) if len(latest) < FAILURES_LIMIT else events.count()
    return {"failures": latest, "failures_count": count}
