"""The scheduler's verbs. Views, API, commands and tasks call these; none writes rows itself."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from scheduler import labels as node_labels
from scheduler.errors import InvalidNodeLabels, InvalidNodeReport, InvalidNodeState
from scheduler.models import (
    Accelerator, AcceleratorSample, HeldWeight, ModelDirectory, Node, NodeEngine, NodeSample,
)
from scheduler.nvml import gpu_class, mig_class
from scheduler.reports import EngineReport, GpuDiscovery, GpuReport, ModelDirectoryReport, NodeReport
from tenancy import audit


def register_node(report: NodeReport) -> Node:
    """Create or update the node a report describes, and the engines it has (idempotent).

    Engines absent from the report are removed: the node is the authority on what it holds.
    A cordoned or draining node keeps its state; a lost one that reports again is ready.
    """
    _validate(report)
    with transaction.atomic():
        node, _ = Node.objects.select_for_update().get_or_create(
            name=report.name, defaults={"address": report.address}
        )
        node.address = report.address
        node.cpu_count = report.cpu_count
        node.memory_total_bytes = report.memory_total_bytes
        node.memory_available_bytes = report.memory_available_bytes
        node.agent_version = report.agent_version
        node.cpu_load_1m = report.cpu_load_1m
        node.unified_memory = report.unified_memory
        now = timezone.now()
        node.last_heartbeat_at = now
        if node.state == Node.State.LOST:
            node.state = Node.State.READY
        if report.gpus is not None:
            node.gpu_source = report.gpus.source
            node.gpu_note = report.gpus.note
            node.driver_version = report.gpus.driver_version
        node.save()
        for engine in report.engines:
            record_engine(node, engine)
        node.engines.exclude(kind__in=[e.kind for e in report.engines]).delete()
        if report.gpus is not None:
            sync_accelerators(node, report.gpus, now)
        if report.model_directories is not None:
            _sync_model_directories(node, report.model_directories)
        _sample_node(node, report, now)
    return node


# --- accelerators -----------------------------------------------------------------------------

_TELEMETRY = ("memory_used_bytes", "utilisation_percent", "temperature_c", "power_watts", "power_limit_watts",
              "throttle_reasons")


def _card_placement(gpu: GpuReport) -> tuple[bool, str]:
    if gpu.healthy is False:
        return False, f"Unhealthy: {gpu.health_reason or 'the card reported a fault.'}"
    if gpu.mig_enabled and not gpu.mig_instances:
        return False, "MIG mode is on but no instances are carved: there is nothing to place on."
    if gpu.mig_enabled:
        return False, f"MIG mode: placed as its {len(gpu.mig_instances)} instance(s), not as a whole card."
    if gpu.memory_total_bytes is None:
        return False, "The card's memory was not read: nothing can be sized against it."
    return True, ""


def sync_accelerators(node: Node, discovery: GpuDiscovery, now=None) -> None:
    """Make the node's accelerator rows match a discovery (idempotent; unchanged rows are not written).

    Cards absent from the discovery are removed; a MIG card's instances follow its current layout.
    Each report also appends one telemetry sample per accelerator, keeping the newest few.
    """
    now = now or timezone.now()
    existing = {a.uuid: a for a in node.accelerators.all()}
    seen: set[str] = set()
    for gpu in discovery.gpus:
        card_class = gpu_class(gpu.name, gpu.memory_total_bytes)
        placeable, reason = _card_placement(gpu)
        throttle = None if gpu.throttle_reasons is None else list(gpu.throttle_reasons)
        card = _upsert_accelerator(node, existing, gpu.uuid, {
            "parent": None, "kind": Accelerator.Kind.GPU, "index": gpu.index, "mig_index": None,
            "name": gpu.name, "accelerator_class": card_class, "profile": "", "pci_bus_id": gpu.pci_bus_id,
            "mig_enabled": gpu.mig_enabled, "memory_total_bytes": gpu.memory_total_bytes,
            "memory_used_bytes": gpu.memory_used_bytes, "utilisation_percent": gpu.utilisation_percent,
            "temperature_c": gpu.temperature_c, "power_watts": gpu.power_watts,
            "power_limit_watts": gpu.power_limit_watts, "throttle_reasons": throttle,
            "healthy": gpu.healthy, "health_reason": gpu.health_reason,
            "placeable": placeable, "unplaceable_reason": reason,
        })
        seen.add(card.uuid)
        _sample(card, now)
        for position, mig in enumerate(gpu.mig_instances):
            mig_uuid = mig.uuid or f"{gpu.uuid}/gi{mig.gpu_instance_id}/ci{mig.compute_instance_id}"
            if gpu.healthy is False:
                mig_ok, mig_reason = False, f"Its card is unhealthy: {gpu.health_reason}"
            elif not mig.profile:
                mig_ok, mig_reason = False, "The MIG profile could not be read."
            elif mig.memory_total_bytes is None:
                mig_ok, mig_reason = False, "The instance's memory was not read."
            else:
                mig_ok, mig_reason = True, ""
            instance = _upsert_accelerator(node, existing, mig_uuid, {
                "parent": card, "kind": Accelerator.Kind.MIG, "index": gpu.index, "mig_index": position,
                "name": f"{gpu.name} MIG {mig.profile}".strip(), "accelerator_class": mig_class(card_class, mig.profile),
                "profile": mig.profile, "pci_bus_id": gpu.pci_bus_id, "mig_enabled": False,
                "memory_total_bytes": mig.memory_total_bytes, "memory_used_bytes": mig.memory_used_bytes,
                # Utilisation, power and temperature are the card's, not an instance's: not measured here.
                "utilisation_percent": None, "temperature_c": None, "power_watts": None,
                "power_limit_watts": None, "throttle_reasons": None,
                "healthy": gpu.healthy, "health_reason": gpu.health_reason,
                "placeable": mig_ok, "unplaceable_reason": mig_reason,
            })
            seen.add(instance.uuid)
            _sample(instance, now)
    # Instances first (they point at cards), then cards no longer reported.
    node.accelerators.exclude(uuid__in=seen).filter(parent__isnull=False).delete()
    node.accelerators.exclude(uuid__in=seen).delete()


def _upsert_accelerator(node: Node, existing: dict[str, Accelerator], uuid: str, values: dict) -> Accelerator:
    row = existing.get(uuid)
    if row is None:
        row = Accelerator.objects.create(node=node, uuid=uuid, **values)
        existing[uuid] = row
        return row
    changed = [field for field, value in values.items() if getattr(row, field) != value]
    if changed:
        for field in changed:
            setattr(row, field, values[field])
        row.save(update_fields=[*changed, "updated_at"])
    return row


def _sample(accelerator: Accelerator, now) -> None:
    values = {field: getattr(accelerator, field) for field in _TELEMETRY}
    if all(value is None for value in values.values()):
        return  # nothing was measured: no sample (an empty one would read as zeros on a chart)
    AcceleratorSample.objects.create(accelerator=accelerator, taken_at=now, **values)
    keep = settings.SCHEDULER_TELEMETRY_SAMPLES
    stale = AcceleratorSample.objects.filter(accelerator=accelerator).values_list("pk", flat=True)[keep:]
    AcceleratorSample.objects.filter(pk__in=list(stale)).delete()


def _sample_node(node: Node, report: NodeReport, now) -> None:
    if report.cpu_load_1m is None and report.memory_available_bytes is None:
        return
    NodeSample.objects.create(node=node, taken_at=now, cpu_load_1m=report.cpu_load_1m,
                              memory_available_bytes=report.memory_available_bytes)
    keep = settings.SCHEDULER_TELEMETRY_SAMPLES
    stale = NodeSample.objects.filter(node=node).values_list("pk", flat=True)[keep:]
    NodeSample.objects.filter(pk__in=list(stale)).delete()


def _sync_model_directories(node: Node, directories: tuple[ModelDirectoryReport, ...]) -> None:
    for report in directories:
        directory, _ = ModelDirectory.objects.get_or_create(node=node, path=report.path)
        held = {w.path: w for w in directory.weights.all()}
        for weight in report.weights:
            row = held.pop(weight.path, None)
            if row is None:
                HeldWeight.objects.create(directory=directory, path=weight.path, size_bytes=weight.size_bytes,
                                          format=weight.format)
            elif (row.size_bytes, row.format) != (weight.size_bytes, weight.format):
                row.size_bytes, row.format = weight.size_bytes, weight.format
                row.save(update_fields=["size_bytes", "format"])
        HeldWeight.objects.filter(pk__in=[w.pk for w in held.values()]).delete()
    node.model_directories.exclude(path__in=[d.path for d in directories]).delete()


# --- node states ------------------------------------------------------------------------------

def mark_lost_nodes(now=None) -> list[str]:
    """Nodes whose heartbeats stopped longer than ``SCHEDULER_NODE_LOST_AFTER`` ago become lost."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.SCHEDULER_NODE_LOST_AFTER)
    lost = []
    with transaction.atomic():
        stale = (Node.objects.select_for_update().exclude(state=Node.State.LOST)
                 .filter(last_heartbeat_at__lt=cutoff).order_by("pk"))
        for node in stale:
            previous = node.state
            node.state = Node.State.LOST
            node.save(update_fields=["state", "updated_at"])
            audit.record(audit.SYSTEM, "node.lost", node,
                         details={"previous_state": previous, "last_heartbeat_at": node.last_heartbeat_at})
            lost.append(node.name)
    return lost


# What each verb moves a node from, and to.
_TRANSITIONS = {
    "cordon": ({Node.State.READY, Node.State.DRAINING}, Node.State.CORDONED),
    "uncordon": ({Node.State.CORDONED, Node.State.DRAINING}, Node.State.READY),
    "drain": ({Node.State.READY, Node.State.CORDONED}, Node.State.DRAINING),
}


def _transition(node: Node, verb: str, actor: audit.Actor, reason: str) -> Node:
    allowed, target = _TRANSITIONS[verb]
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        if node.state == target:
            return node  # asked twice: already done, nothing to record
        if node.state not in allowed:
            raise InvalidNodeState(
                f"Cannot {verb} node {node.name}: it is {node.get_state_display().lower()}.",
                details={"state": node.state, "allowed_from": sorted(allowed)})
        previous = node.state
        node.state = target
        node.save(update_fields=["state", "updated_at"])
        audit.record(actor, f"node.{verb}", node, details={"from": previous, "to": target, "reason": reason})
    return node


def cordon(node: Node, actor: audit.Actor, reason: str = "") -> Node:
    """No new work is placed on the node; what runs there keeps running."""
    return _transition(node, "cordon", actor, reason)


def uncordon(node: Node, actor: audit.Actor, reason: str = "") -> Node:
    return _transition(node, "uncordon", actor, reason)


def drain(node: Node, actor: audit.Actor, reason: str = "") -> Node:
    """No new work, and Serving moves what runs there elsewhere (its reconcile loop reads the state)."""
    return _transition(node, "drain", actor, reason)


def set_labels(node: Node, actor: audit.Actor, labels: dict) -> Node:
    """Replace the node's labels (an admin's: what catalog profiles' node selectors match). Nodes
    never set them in their reports, so a heartbeat cannot undo them."""
    problems = node_labels.problems(labels)
    if problems:
        raise InvalidNodeLabels(f"Those are not node labels: {' '.join(problems)}",
                                details={"problems": [{"field": "labels", "message": p} for p in problems]})
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        previous = dict(node.labels or {})
        if previous == labels:
            return node
        node.labels = dict(labels)
        node.save(update_fields=["labels", "updated_at"])
        audit.record(actor, "node.labels", node, details={"from": previous, "to": node.labels})
    return node


def record_engine(node: Node, engine: EngineReport) -> NodeEngine:
    """One engine of a validated report (``_validate``) as the node's row."""
    row, _ = NodeEngine.objects.update_or_create(
        node=node, kind=engine.kind,
        defaults={"version": engine.version, "source": engine.source, "path": engine.path,
                  "state": engine.state, "detail": engine.detail},
    )
    return row


def _validate(report: NodeReport) -> None:
    problems = {}
    if not report.name or len(report.name) > 253:
        problems["name"] = "A node needs a name of 1 to 253 characters."
    if not report.address:
        problems["address"] = "A node needs an address where its engines are reached."
    if report.cpu_load_1m is not None and report.cpu_load_1m < 0:
        problems["cpu_load_1m"] = "Must be absent (not measured) or zero and above."
    if report.gpus is not None:
        uuids = [g.uuid for g in report.gpus.gpus] + [m.uuid for g in report.gpus.gpus for m in g.mig_instances if m.uuid]
        if any(not u for u in (g.uuid for g in report.gpus.gpus)):
            problems["gpus"] = "Every GPU needs its UUID."
        elif len(uuids) != len(set(uuids)):
            problems["gpus"] = "GPU and MIG UUIDs must be unique."
    for field in ("cpu_count", "memory_total_bytes", "memory_available_bytes"):
        value = getattr(report, field)
        if value is not None and value < 0:
            problems[field] = "Must be absent (not measured) or zero and above."
    engine_problems = [_engine_problem(engine) for engine in report.engines]
    if any(engine_problems):
        problems["engines"] = "; ".join(problem for problem in engine_problems if problem)
    if problems:
        raise InvalidNodeReport("The node report is invalid.", details=problems)


def _engine_problem(engine: EngineReport) -> str:
    """What is wrong with one engine a node reports (a node's word is checked like any input), or ""."""
    if engine.kind not in NodeEngine.Kind.values:
        return f"unknown engine kind {engine.kind!r} (known: {', '.join(NodeEngine.Kind.values)})"
    if engine.state not in NodeEngine.State.values:
        return f"{engine.kind}: unknown state {engine.state!r} (known: {', '.join(NodeEngine.State.values)})"
    for field in ("version", "source", "path"):
        limit = NodeEngine._meta.get_field(field).max_length
        if len(getattr(engine, field) or "") > limit:
            return f"{engine.kind}: {field} is longer than {limit} characters"
    if not engine.version:
        return f"{engine.kind}: a version is needed"
    return ""
