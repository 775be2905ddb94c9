"""Will a proposed deployment fit a budget, and if not, what would make it fit.

``fit = estimate ≤ free_for_new`` where ``free_for_new = total − reserved − safety margin −
memory used outside Berth`` (measured use minus what Berth's replicas account for). When it
does not fit, ``plan_fit`` returns plans, cheapest first, each with the fit it would give:
configuration patches, other variants of the model, or actions on resident deployments (sleep
those that can sleep, stop lower-priority ones). Plans are suggestions; nothing here changes
anything. Serving feeds residents as plain data; this module never looks at its tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from scheduler.estimation.engines import Estimate, LlamaCppConfig, VllmConfig


@dataclasses.dataclass(frozen=True)
class Budget:
    total_bytes: int
    reserved_bytes: int = 0  # held by Berth's deployments
    measured_used_bytes: int | None = None  # None: not measured
    accounted_bytes: int = 0  # of the measured use, what Berth's replicas account for
    safety_margin_bytes: int = 0
    label: str = ""

    @property
    def outside_bytes(self) -> int | None:
        if self.measured_used_bytes is None:
            return None
        return max(0, self.measured_used_bytes - self.accounted_bytes)

    @property
    def free_for_new(self) -> int:
        # Unknown outside use is not taken as zero silently: the fit says it was not measured.
        return self.total_bytes - self.reserved_bytes - self.safety_margin_bytes - (self.outside_bytes or 0)


def safety_margin(total_bytes: int, *, unified_memory: bool, unified_bytes: int, gpu_percent: int) -> int:
    """A fixed amount on unified-memory machines (and CPU nodes); a share of a discrete GPU."""
    return unified_bytes if unified_memory else total_bytes * gpu_percent // 100


@dataclasses.dataclass(frozen=True)
class Resident:
    """A deployment's replica already holding memory in this budget."""

    name: str
    memory_bytes: int
    priority: int = 0
    can_sleep: bool = False
    sleep_frees_bytes: int | None = None  # None: sleeping frees everything but the weights (unknown)
    sleeping: bool = False


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An alternative to the proposal: a configuration patch or another variant, already estimated."""

    kind: str  # "config" or "variant"
    label: str
    estimate_bytes: int
    cost: int
    config_patch: dict[str, Any] = dataclasses.field(default_factory=dict)
    variant: str = ""


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # "sleep" or "stop"
    target: str
    frees_bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str  # "config", "variant" or "actions"
    label: str
    estimate_bytes: int
    free_after_bytes: int
    cost: int
    config_patch: dict[str, Any] = dataclasses.field(default_factory=dict)
    variant: str = ""
    actions: tuple[Action, ...] = ()

    @property
    def headroom_bytes(self) -> int:
        return self.free_after_bytes - self.estimate_bytes


@dataclasses.dataclass(frozen=True)
class Fit:
    fits: bool
    estimate_bytes: int
    free_for_new_bytes: int
    shortfall_bytes: int
    total_bytes: int
    reserved_bytes: int
    safety_margin_bytes: int
    outside_bytes: int | None
    plans: tuple[Plan, ...] = ()
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for plan, raw in zip(self.plans, data["plans"]):
            raw["headroom_bytes"] = plan.headroom_bytes
        return data


def check_fit(budget: Budget, estimate_bytes: int) -> Fit:
    free = budget.free_for_new
    notes = ()
    if budget.outside_bytes is None:
        notes = ("Memory used outside Berth was not measured: the fit counts only reservations and the margin.",)
    return Fit(fits=estimate_bytes <= free, estimate_bytes=estimate_bytes, free_for_new_bytes=free,
               shortfall_bytes=max(0, estimate_bytes - free), total_bytes=budget.total_bytes,
               reserved_bytes=budget.reserved_bytes, safety_margin_bytes=budget.safety_margin_bytes,
               outside_bytes=budget.outside_bytes, notes=notes)


def plan_fit(budget: Budget, estimate_bytes: int, *, candidates: Sequence[Candidate] = (),
             residents: Sequence[Resident] = (), priority: int = 0, max_plans: int = 6) -> Fit:
    """The fit, and when it does not fit, the plans that would make it fit (cheapest first)."""
    fit = check_fit(budget, estimate_bytes)
    if fit.fits:
        return fit
    free = fit.free_for_new_bytes
    plans: list[Plan] = []
    for candidate in sorted(candidates, key=lambda c: (c.cost, -c.estimate_bytes)):
        if candidate.estimate_bytes <= free:
            plans.append(Plan(kind=candidate.kind, label=candidate.label, estimate_bytes=candidate.estimate_bytes,
                              free_after_bytes=free, cost=candidate.cost, config_patch=candidate.config_patch,
                              variant=candidate.variant))
    plans.extend(_action_plans(free, estimate_bytes, residents, priority))
    plans.sort(key=lambda p: (p.cost, -p.headroom_bytes))
    return dataclasses.replace(fit, plans=tuple(_distinct(plans)[:max_plans]))


def _distinct(plans: list[Plan]) -> list[Plan]:
    seen, result = set(), []
    for plan in plans:
        key = (plan.kind, plan.label)
        if key not in seen:
            seen.add(key)
            result.append(plan)
    return result


def _sleep_frees(resident: Resident) -> int:
    return resident.sleep_frees_bytes if resident.sleep_frees_bytes is not None else 0


def _action_plans(free: int, needed: int, residents: Sequence[Resident], priority: int) -> list[Plan]:
    plans = []
    sleepable = sorted((r for r in residents if r.can_sleep and not r.sleeping and _sleep_frees(r) > 0),
                       key=lambda r: (r.priority, -_sleep_frees(r), r.name))
    stoppable = sorted((r for r in residents if r.priority < priority),
                       key=lambda r: (r.priority, -r.memory_bytes, r.name))

    def gather(pool, frees, kind, start_free, already=()):
        actions, gained = list(already), start_free
        for resident in pool:
            if gained >= needed:
                break
            if any(a.target == resident.name for a in actions):
                continue
            amount = frees(resident)
            actions.append(Action(kind, resident.name, amount))
            gained += amount
        return actions, gained

    sleeps, after_sleep = gather(sleepable, _sleep_frees, "sleep", free)
    if after_sleep >= needed and sleeps:
        plans.append(Plan(kind="actions", label=_describe(sleeps), estimate_bytes=needed, free_after_bytes=after_sleep,
                          cost=10 + len(sleeps), actions=tuple(sleeps)))
    stops, after_stop = gather(stoppable, lambda r: r.memory_bytes, "stop", free)
    if after_stop >= needed and stops:
        plans.append(Plan(kind="actions", label=_describe(stops), estimate_bytes=needed, free_after_bytes=after_stop,
                          cost=20 + len(stops) * 2, actions=tuple(stops)))
    if after_sleep < needed and sleeps:
        # Sleeping is not enough alone: sleep what can sleep, then stop lower-priority ones.
        slept = {a.target for a in sleeps}
        rest = [r for r in stoppable if r.name not in slept]
        both, after_both = gather(rest, lambda r: r.memory_bytes, "stop", after_sleep, sleeps)
        if after_both >= needed:
            plans.append(Plan(kind="actions", label=_describe(both), estimate_bytes=needed,
                              free_after_bytes=after_both, cost=20 + len(both) * 2, actions=tuple(both)))
    return plans


def _describe(actions: Sequence[Action]) -> str:
    return ", ".join(f"{a.kind} {a.target}" for a in actions)


# --- configuration patches ------------------------------------------------------------------------

Estimator = Callable[[Any], Estimate]


def llamacpp_candidates(config: LlamaCppConfig, estimate: Estimator, context: int) -> list[Candidate]:
    """Cheaper llama.cpp configurations, each estimated: a quantised KV cache, a shorter context,
    fewer parallel slots, fewer GPU layers (slowest: layers run on the CPU)."""
    candidates = []

    def add(label: str, cost: int, patch: dict[str, Any]) -> None:
        patched = dataclasses.replace(config, **patch)
        candidates.append(Candidate("config", label, estimate(patched).total_bytes, cost, patch))

    if config.cache_type_k == "f16" or config.cache_type_v == "f16":
        add("KV cache as q8_0", 1, {"cache_type_k": "q8_0", "cache_type_v": "q8_0"})
        add("KV cache as q4_0", 2, {"cache_type_k": "q4_0", "cache_type_v": "q4_0"})
    step, shorter = 3, context // 2
    while shorter >= 512 and shorter * config.parallel >= 256:
        add(f"context {shorter:,} tokens", step, {"ctx_size": shorter})
        shorter //= 2
        step += 1
    parallel = config.parallel // 2
    while parallel >= 1:
        add(f"{parallel} parallel slot(s)", 4, {"parallel": parallel, "ctx_size": context // config.parallel * parallel})
        parallel //= 2
    if config.n_gpu_layers != 0:
        layers = config.n_gpu_layers if config.n_gpu_layers > 0 else None
        if layers is None:
            first = estimate(config)
            layers = int(first.inputs.get("n_gpu_layers", 0))
        for fewer in (layers * 3 // 4, layers // 2, layers // 4):
            if 0 < fewer < layers:
                add(f"{fewer} GPU layers (the rest on the CPU)", 8, {"n_gpu_layers": fewer})
    return candidates


def vllm_candidates(config: VllmConfig, estimate: Estimator, max_len: int) -> list[Candidate]:
    candidates = []

    def add(label: str, cost: int, patch: dict[str, Any]) -> None:
        patched = dataclasses.replace(config, **patch)
        candidates.append(Candidate("config", label, estimate(patched).total_bytes, cost, patch))

    if config.kv_cache_dtype == "auto":
        add("KV cache as fp8", 1, {"kv_cache_dtype": "fp8"})
    seqs = config.max_num_seqs // 2
    while seqs >= 1:
        add(f"max_num_seqs {seqs}", 2, {"max_num_seqs": seqs})
        seqs //= 4
    shorter, step = max_len // 2, 3
    while shorter >= 1024:
        add(f"max_model_len {shorter:,}", step, {"max_model_len": shorter})
        shorter //= 2
        step += 1
    return candidates
