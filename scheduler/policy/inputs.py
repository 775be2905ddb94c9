"""The placement policy's inputs and outputs: plain, frozen data, no Django.

Serving's reconcile loop builds a :class:`Snapshot` from its rows (scheduler's own rows give the
inventory part, see ``scheduler/snapshot.py``), calls ``plan.schedule`` and applies the
:class:`Plan`. Sizes are bytes, times are seconds on the caller's clock (``Snapshot.now``).
Unknown is not zero: a figure that was not reported is ``None`` and constrains nothing, an idle
time that is not known is not idle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

GIB = 2**30

CRITICAL, STANDARD, OPPORTUNISTIC = "critical", "standard", "opportunistic"
CLASS_RANK = {OPPORTUNISTIC: 1, STANDARD: 2, CRITICAL: 3}

# Defaults (llmgw's constants; the caller may override them per snapshot).
MIN_LIFETIME_S = 300
PREEMPT_GRACE_S = 30
PREEMPT_HOLD_S = 300
MAX_VICTIMS = 3
EVICTION_GRACE_S = 120
PARK_AFTER = 5
LOG_REPEAT_S = 600


@dataclasses.dataclass(frozen=True)
class AcceleratorInfo:
    id: str  # stable id (the accelerator's public id or uuid)
    index: int
    accelerator_class: str = ""
    memory_bytes: int | None = None  # usable for placement: total − safety margin − use outside Berth
    placeable: bool = True
    unplaceable_reason: str = ""
    mig: bool = False  # a MIG instance: takes exactly one single-accelerator replica
    # The physical card this unit is on: a MIG instance's parent GPU ("" for a whole GPU: itself).
    # Spread counts cards, not units: two MIG instances of one card share its failures.
    card: str = ""

    @property
    def card_id(self) -> str:
        return self.card or self.id


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str = "ready"  # ready / cordoned / draining / lost
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    engines: frozenset[str] = frozenset()  # engine kinds installed and ready
    engines_installing: frozenset[str] = frozenset()
    cpu_count: int | None = None
    memory_bytes: int | None = None  # RAM usable for CPU replicas (total − margin); None: not reported
    disk_free_bytes: int | None = None
    weights: frozenset[str] = frozenset()  # weights keys the node holds
    accelerators: tuple[AcceleratorInfo, ...] = ()


@dataclasses.dataclass(frozen=True)
class Profile:
    """One way to run a model. ``gpus == 0`` is a CPU profile (``memory_bytes`` of RAM and
    ``cpu_cores`` reserved); otherwise ``gpus`` accelerators of one node, each needing
    ``memory_bytes`` (tensor parallel never spans nodes)."""

    name: str
    engine: str = "llamacpp"
    gpus: int = 1
    memory_bytes: int = 0
    cpu_cores: int = 0
    # "" (or ()) accepts any class; one class or a tuple of them. A class names a family too:
    # "h100" takes "h100-80g" and "h100-94g" (see ``placement.class_matches``).
    accelerator_class: str | tuple[str, ...] = ""
    allow_mig: bool = True
    min_disk_bytes: int = 0
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    priority: int = 0  # higher first
    tokens_per_s: float | None = None  # measured per replica; None: not benchmarked
    max_concurrency: int | None = None  # measured: the most requests in flight that met the SLO

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def classes(self) -> tuple[str, ...]:
        wanted = self.accelerator_class
        return (wanted,) if isinstance(wanted, str) and wanted else tuple(wanted or ())

    @property
    def class_text(self) -> str:
        """How a refusal names the classes: "h100", "h100 or a100"; "any class" when none is asked."""
        return " or ".join(self.classes) or "any class"

    def footprint(self, extra_bytes: int = 0) -> int:
        return (self.memory_bytes + extra_bytes) * max(self.gpus, 1)


@dataclasses.dataclass(frozen=True)
class Draft:
    """A speculative-decoding companion: rides with its primary on the same accelerators."""

    model: str
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class Scaling:
    min: int = 1
    max: int | None = None  # None: follows min
    idle_timeout_s: int = 900

    @property
    def upper(self) -> int:
        return max(self.min, self.max if self.max is not None else self.min)

    @property
    def on_demand(self) -> bool:
        return self.min == 0


@dataclasses.dataclass(frozen=True)
class DesiredModel:
    id: str
    profiles: tuple[Profile, ...]
    scaling: Scaling = Scaling()
    capacity_class: str = ""  # "" → on-demand: opportunistic, else standard
    owner: str = ""  # scope path ("acme/ml"); "" shared, counted against nobody
    priority: int = 1  # worth of one replica; higher is kept first
    pinned: bool = False
    draft: Draft | None = None
    weights_key: str = ""
    fingerprint: str = ""
    fallbacks: tuple[str, ...] = ()
    last_requested_at: float | None = None  # None: not known (never, or since a restart)
    waiting: int = 0  # requests waiting now for a model with no replica (an on-demand load)
    waiting_since: float | None = None  # when the oldest of those began waiting
    # Every request waiting is at the batch priority (a Batch API line, a batch client): it is loaded
    # only where room is free; nothing running is preempted for it.
    waiting_batch_only: bool = False
    extra: int = 0  # replicas added for load (scaling.step keeps it)
    # How the recovery ladder's last rung runs it (level 2: the smallest context, one slot, on the CPU
    # where its engine can); empty: as its own profiles.
    minimal: tuple[Profile, ...] = ()
    # A rolling restart asked at this moment: its replicas created before it are replaced one at a
    # time (the new one ready before the old stops). None: none asked.
    restart_before: float | None = None

    @property
    def effective_class(self) -> str:
        if self.capacity_class:
            return self.capacity_class
        return OPPORTUNISTIC if self.scaling.on_demand else STANDARD

    @property
    def rank(self) -> int:
        return CLASS_RANK[self.effective_class]


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    id: str
    model: str
    profile: str
    node: str
    accelerators: tuple[str, ...] = ()  # accelerator ids; () for CPU
    memory_bytes: int = 0  # per accelerator (GPU) or RAM (CPU), the draft's share included
    cpu_cores: int = 0
    state: str = "ready"  # starting / ready / sleeping (its device memory freed, its weights in host memory)
    pinned: bool = False
    active_requests: int = 0
    last_used_at: float | None = None  # None: not known, so not idle
    ready_since: float | None = None  # None: not ready yet
    load_seconds: float | None = None  # how long it took to load; None: unknown
    created_at: float = 0.0
    fingerprint: str = ""
    load_added: bool = False
    spans_nodes: bool = False
    # What it keeps in the node's host memory asleep (vLLM's level-1 sleep: its weights); 0: it
    # cannot sleep (an engine without sleep mode), so making room stops it.
    sleep_host_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Resources:
    gpus: float | None = None
    cores: float | None = None
    gpu_memory_gib: float | None = None

    def items(self):
        return (("gpus", self.gpus), ("cores", self.cores), ("gpu_memory_gib", self.gpu_memory_gib))


@dataclasses.dataclass(frozen=True)
class ScopeContract:
    path: str  # "acme", "acme/ml"
    written: str = ""  # how people read it, e.g. "team:acme/ml"
    guarantee: Resources = Resources()
    limit: Resources = Resources()


@dataclasses.dataclass(frozen=True)
class FailureState:
    """A model's recent launch failures (Serving keeps it; recovery.next_step reads it)."""

    kind: str = ""  # crash / oom / hang; "" none
    consecutive: int = 0
    last_failure_at: float | None = None
    level: int = 0  # 0 full, 1 degraded, 2 minimal (the last rung before parking)
    parked: bool = False
    parked_fingerprint: str = ""
    last_error: str = ""


@dataclasses.dataclass(frozen=True)
class Hold:
    model: str
    until: float
    beneficiary: str


@dataclasses.dataclass(frozen=True)
class Settings:
    min_lifetime_s: float = MIN_LIFETIME_S
    preempt_grace_s: float = PREEMPT_GRACE_S
    preempt_hold_s: float = PREEMPT_HOLD_S
    max_victims: int = MAX_VICTIMS
    eviction_grace_s: float = EVICTION_GRACE_S
    park_after: int = PARK_AFTER
    base_backoff_s: float = 10
    max_backoff_s: float = 300
    crash_retries: int = 4  # the fifth crash in a row parks the model (park_after)
    starved_after_s: float = 30  # a load waiting this long may push out idle replicas of its class worth more
    exhaustive_packing_limit: int = 400  # demands; above it, only the first greedy ordering is tried
    # A replica that can sleep is put to sleep, not stopped, when room is made or it goes idle, if its
    # model was asked for within this long; asleep this long unasked, it is stopped.
    sleep_window_s: float = 3600


@dataclasses.dataclass(frozen=True)
class Snapshot:
    now: float
    nodes: tuple[NodeInfo, ...] = ()
    models: tuple[DesiredModel, ...] = ()
    replicas: tuple[ReplicaInfo, ...] = ()
    contracts: tuple[ScopeContract, ...] = ()
    failures: Mapping[str, FailureState] = dataclasses.field(default_factory=dict)
    holds: tuple[Hold, ...] = ()
    settings: Settings = Settings()

    def digest(self) -> str:
        """A stable digest of the inputs (for the decision row)."""
        text = json.dumps(_plain(self), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- outputs -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Launch:
    model: str
    profile: str
    node: str
    accelerators: tuple[str, ...]
    memory_bytes: int  # per accelerator (GPU) or RAM (CPU): what to reserve
    cpu_cores: int = 0
    level: int = 0  # 0 full, 1 degraded (shorter context, fewer GPU layers), 2 minimal
    serves_for: str = ""  # a fallback launched in place of this model
    draft: str = ""
    reason: str = ""  # minimum / pinned / on-demand / load / desired
    beneficiary_of: tuple[str, ...] = ()  # replicas evicted to make room


@dataclasses.dataclass(frozen=True)
class Eviction:
    replica: str
    model: str
    reason: str  # idle / surplus / preempted / not-desired / drained / restarted
    grace_s: float = 0
    beneficiary: str = ""
    tier: int | None = None
    # Put to sleep rather than stopped: its device memory is freed all the same, and a request wakes
    # it in seconds instead of a reload (``Settings.sleep_window_s``).
    sleep: bool = False


@dataclasses.dataclass(frozen=True)
class Wake:
    """A sleeping replica woken (through the start-up gate) instead of a new one launched."""

    replica: str
    model: str
    node: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Unschedulable:
    model: str
    reason: str
    code: str
    missing: int = 1


@dataclasses.dataclass(frozen=True)
class Decision:
    """The evidence for one model's part of a plan."""

    model: str
    verdict: str  # placed / preempted / evicted / unschedulable / parked / held
    codes: tuple[str, ...]
    node: str = ""
    accelerators: tuple[str, ...] = ()
    victims: tuple[str, ...] = ()
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Move:
    """A replica that is leaving — its node drains, or its model restarts — and where that stands:
    ``waiting`` for its replacement to be ready, ``blocked`` (it cannot be moved: ``detail`` says
    why), or ``stopping`` (its replacement is ready: the plan stops it)."""

    replica: str
    model: str
    node: str
    why: str  # drain / restart
    state: str  # waiting / blocked / stopping
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    launches: tuple[Launch, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    unschedulable: tuple[Unschedulable, ...] = ()
    holds: tuple[Hold, ...] = ()
    decisions: tuple[Decision, ...] = ()
    inputs_digest: str = ""
    moves: tuple[Move, ...] = ()
    wakes: tuple[Wake, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.launches and not self.evictions and not self.wakes

    def fingerprint(self) -> str:
        text = json.dumps(_plain((self.launches, self.evictions, self.unschedulable, self.wakes)), sort_keys=True,
                          default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return _plain(self)


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value
