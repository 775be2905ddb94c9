"""The inventory part of the placement policy's snapshot, built from scheduler's own rows.

Serving's reconcile loop supplies the rest (scheduler never reads Serving's tables):

* ``models`` — one :class:`~scheduler.policy.inputs.DesiredModel` per catalog entry: its profiles
  (engine, GPUs per replica, memory per accelerator or RAM, cores, class, selector, priority and
  measured tokens/s and max concurrency), scaling (min, max, idle timeout), capacity class, owner
  scope path, priority, pinned, draft, weights key, fingerprint, fallbacks, when it was last
  requested (``None`` when not known), requests waiting for a first replica, and ``extra`` — the
  load-added replicas that ``scheduler.policy.scaling.step`` keeps per model.
* ``replicas`` — one :class:`~scheduler.policy.inputs.ReplicaInfo` per counting replica (placing,
  starting, ready): its node and accelerator ids (``str(Accelerator.public_id)``), memory per
  accelerator (what it reserved, its draft's share included), cores, pinned, active requests,
  last used and ready since (``None`` when not known), load time, created at, load-added.
* ``contracts`` — :func:`contracts_from_tenancy` below turns tenancy's contracts into plain data.
* ``failures`` (the recovery ladder's memory per model: ``scheduler.recovery_service.failure_states()``)
  and ``holds`` (carried from the last plan).

The reconcile loop then applies the plan: evictions first (with their grace), then launches
(reserving memory with ``scheduler.memory.reserve_memory`` under the node's lock), and records it
with ``scheduler.placement_service.record_plan``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import PurePosixPath
from typing import Callable

from django.db.models import Prefetch

from scheduler import memory
from scheduler.conf import policy_settings
from scheduler.models import Accelerator, MemoryReservation, ModelDirectory, Node, NodeEngine
from scheduler.policy.inputs import AcceleratorInfo, NodeInfo, ReplicaInfo, Resources, ScopeContract, Snapshot
from scheduler.recovery_service import failure_states
from tenancy.models import Contract

__all__ = ["contracts_from_tenancy", "current_snapshot", "inventory", "policy_settings", "register_provider",
           "reservations_as_replicas"]


def _accelerator(node: Node, acc: Accelerator, cards: dict[int, str]) -> AcceleratorInfo | None:
    if acc.kind == Accelerator.Kind.GPU and acc.mig_enabled:
        return None  # a card in MIG mode: its instances are the units
    budget = memory.budget_for(node, acc)
    usable = None
    if budget is not None:
        # Berth's own reservations come back as replicas: the fleet subtracts those itself.
        usable = budget.free_for_new + budget.reserved_bytes
    return AcceleratorInfo(id=str(acc.public_id), index=acc.index, accelerator_class=acc.accelerator_class,
                           memory_bytes=usable, placeable=acc.placeable and acc.healthy is not False,
                           unplaceable_reason=acc.unplaceable_reason or acc.health_reason,
                           mig=acc.kind == Accelerator.Kind.MIG,
                           # Spread counts physical GPUs: a MIG instance is on its parent card.
                           card=cards.get(acc.parent_id, "") if acc.parent_id else "")


def node_info(node: Node) -> NodeInfo:
    engines = frozenset(e.kind for e in node.engines.all() if e.state == NodeEngine.State.READY)
    ram = memory.budget_for(node, None)
    held = [w.path for d in node.model_directories.all() for w in d.weights.all()]
    # A model in a folder (safetensors) is keyed by its folder: a folder counts as held where the
    # node holds files in it.
    weights = frozenset(held) | frozenset(str(PurePosixPath(p).parent) for p in held if "/" in p)
    units = list(node.accelerators.all())
    cards = {acc.pk: str(acc.public_id) for acc in units}
    return NodeInfo(
        name=node.name, state=node.state, labels=dict(node.labels or {}), engines=engines,
        cpu_count=node.cpu_count,
        memory_bytes=None if ram is None else ram.free_for_new + ram.reserved_bytes,
        weights=weights,
        accelerators=tuple(a for a in (_accelerator(node, acc, cards) for acc in units) if a is not None))


def inventory(nodes=None) -> tuple[NodeInfo, ...]:
    """Every node (or those of ``nodes``, a queryset) as the policy's plain data."""
    queryset = (nodes if nodes is not None else Node.objects.all()).prefetch_related(
        "engines", Prefetch("accelerators", queryset=Accelerator.objects.order_by("index", "mig_index")),
        Prefetch("model_directories", queryset=ModelDirectory.objects.prefetch_related("weights")))
    return tuple(node_info(node) for node in queryset)


def contracts_from_tenancy() -> tuple[ScopeContract, ...]:
    """Tenancy's capacity contracts as plain data (GPUs, cores, GPU memory in GiB)."""
    def figures(contract, side):
        def value(stem):
            raw = getattr(contract, f"{stem}_{side}")
            return None if raw is None else float(raw)
        return Resources(gpus=value("gpus"), cores=value("cores"), gpu_memory_gib=value("gpu_memory_gib"))

    return tuple(ScopeContract(path=c.scope.path, written=c.scope.written, guarantee=figures(c, "guarantee"),
                               limit=figures(c, "limit"))
                 for c in Contract.objects.select_related("scope").order_by("scope__path"))


def reservations_as_replicas() -> tuple:
    """Memory reservations as pinned stand-in replicas, so a dry run without Serving's replicas
    still sees the memory they hold (never evicted: the policy does not know what they are)."""
    rows = MemoryReservation.objects.select_related("node", "accelerator").order_by("holder")
    held: dict[str, list] = {}  # a tensor-parallel replica's shards are one stand-in on several accelerators
    for r in rows:
        held.setdefault(memory.base_holder(r.holder), []).append(r)
    return tuple(ReplicaInfo(id=f"reservation:{holder}", model=f"reservation:{holder}", profile="",
                             node=shards[0].node.name, memory_bytes=shards[0].bytes, pinned=True,
                             accelerators=tuple(str(r.accelerator.public_id) for r in shards if r.accelerator_id))
                 for holder, shards in held.items())


_provider: Callable[[], Snapshot] | None = None


def register_provider(provider: Callable[[], Snapshot]) -> None:
    """Name the callable that builds the running system's full snapshot (Serving registers its
    reconcile loop's builder when the app loads): scheduler never imports the apps above it."""
    global _provider
    _provider = provider


def current_snapshot(models=(), *, now: float | None = None):
    """A snapshot for dry runs asked from the API or console: the inventory, the reservations and
    ``models``. When a provider is registered (``register_provider``), it returns the full snapshot
    instead and ``models`` are added to it."""
    if _provider is not None:
        snap = _provider()
        known = {m.id for m in models}
        return dataclasses.replace(snap, models=tuple(m for m in snap.models if m.id not in known) + tuple(models))
    return Snapshot(now=time.time() if now is None else now, nodes=inventory(), models=tuple(models),
                    replicas=reservations_as_replicas(), contracts=contracts_from_tenancy(),
                    failures=failure_states(), settings=policy_settings())
