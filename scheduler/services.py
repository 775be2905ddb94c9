"""The scheduler's verbs. Views, API, commands and tasks call these; none writes rows itself."""

from __future__ import annotations

import dataclasses

from django.db import transaction
from django.utils import timezone

from scheduler.errors import InvalidNodeReport
from scheduler.models import Node, NodeEngine


@dataclasses.dataclass(frozen=True)
class EngineReport:
    kind: str
    version: str
    source: str = ""
    path: str = ""
    state: str = NodeEngine.State.READY
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """What a node says of itself. ``None`` means "not measured", never zero."""

    name: str
    address: str
    cpu_count: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    agent_version: str = ""
    engines: tuple[EngineReport, ...] = ()


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
        node.last_heartbeat_at = timezone.now()
        if node.state == Node.State.LOST:
            node.state = Node.State.READY
        node.save()
        for engine in report.engines:
            record_engine(node, engine)
        node.engines.exclude(kind__in=[e.kind for e in report.engines]).delete()
    return node


def record_engine(node: Node, engine: EngineReport) -> NodeEngine:
    if engine.kind not in NodeEngine.Kind.values:
        raise InvalidNodeReport(f"Unknown engine kind {engine.kind!r}.", details={"kinds": NodeEngine.Kind.values})
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
    for field in ("cpu_count", "memory_total_bytes", "memory_available_bytes"):
        value = getattr(report, field)
        if value is not None and value < 0:
            problems[field] = "Must be absent (not measured) or zero and above."
    if problems:
        raise InvalidNodeReport("The node report is invalid.", details=problems)
