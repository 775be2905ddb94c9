"""What should be resident: desired counts, idle unload, surplus eviction, and a cost-aware packer.

Pinned models and models below their minimum come first, then the rest; within each tier the
packer looks at what a placement costs (bytes) as well as what it is worth (priority): it tries a
priority-first and a worth-per-byte-first order with best fit and keeps the better, then swaps a
few cheap placements out for a more valuable one when that gains. A small batch that still does not
fit gets a bounded exact search, then a local search that re-solves pairs and triples of
accelerators exactly. Resident replicas are never moved by the packer, so a converged state stays
put.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from typing import Sequence

from scheduler.policy.inputs import DesiredModel, Profile, ReplicaInfo
from scheduler.policy.placement import Fleet, Placer, Spot
from scheduler.policy.quotas import Quotas, need_of

DEFAULT_LOAD_S = 60.0
RESTART_LIMIT, RESTARTS = 60, 64  # small batches get perturbed restarts of the greedy
EXACT_DEMANDS, EXACT_ACCELERATORS = 40, 64  # small enough for a bounded exact search
# Search budgets are counts of nodes, never times, so the same input always gets the same plan.
EXACT_NODES = 5_000  # the exact search over the whole small batch
# The repack (a local search): groups of accelerators re-solved exactly with what is unplaced.
# Pairs on up to 16 accelerators (120 pairs), then triples on up to 12 (220 triples); each group
# is searched at most this far, and each of the two stops at REPACK_NODES in all.
PAIR_ACCELERATORS, PAIR_NODES = 16, 2_000
TRIPLE_ACCELERATORS, TRIPLE_NODES = 12, 1_000
REPACK_NODES = 20_000


def desired_count(model: DesiredModel, replicas: Sequence[ReplicaInfo], now: float) -> tuple[int, int, str]:
    """(desired, base, why). On-demand (min 0) models: base 1 while requests wait, and while a
    replica runs that was requested within the idle timeout or whose idle time is not known. A
    model with no replica loads only when a request waits for it: being used recently does not
    load it again (a replica that was preempted comes back on its next request, not before)."""
    scaling = model.scaling
    if scaling.on_demand:
        last = model.last_requested_at
        if model.waiting > 0:
            base, why = 1, "on-demand: requests waiting"
        elif replicas and last is not None and now - last < scaling.idle_timeout_s:
            base, why = 1, "on-demand: requested within its idle timeout"
        elif replicas and last is None:
            base, why = 1, "on-demand: idle time not known, so not idle"
        else:
            base, why = 0, "on-demand: idle"
    else:
        base, why = scaling.min, "minimum"
    if model.pinned and base < 1:
        base, why = 1, "pinned"
    upper = max(scaling.upper, base)
    extra = max(model.extra, 0) if base > 0 else 0  # load scaling acts only above a base of one or more
    return min(base + extra, upper), base, why


def eviction_score(replica: ReplicaInfo, now: float) -> tuple:
    """Higher first: frees the most memory for the least expected reload cost (idle ÷ load time).
    Unknown idle time is not idle (score 0)."""
    size = replica.memory_bytes * max(len(replica.accelerators), 1)
    idle = (now - replica.last_used_at) if replica.last_used_at is not None else 0.0
    load = replica.load_seconds if replica.load_seconds else DEFAULT_LOAD_S
    return (size * max(idle, 0.0) / load, replica.load_added, replica.created_at, replica.id)


def surplus(replicas: Sequence[ReplicaInfo], count: int, now: float, *, idle_only_after: float | None,
            protected) -> list[ReplicaInfo]:
    """Which replicas to stop to come down to ``count``: never pinned or active ones; when the
    model went idle (``idle_only_after``), only replicas known to be idle that long."""
    excess = len(replicas) - count
    if excess <= 0:
        return []
    pool = [r for r in replicas if not protected(r)]
    if idle_only_after is not None:
        pool = [r for r in pool if r.last_used_at is not None and now - r.last_used_at >= idle_only_after]
    pool.sort(key=lambda r: eviction_score(r, now), reverse=True)
    return pool[:excess]


@dataclasses.dataclass
class Demand:
    model: DesiredModel
    slot: int  # which missing replica of the model (0, 1, …)
    tier: int  # 0 pinned, 1 below minimum / on-demand load, 2 the rest
    reason: str
    profiles: tuple[Profile, ...]
    extra_bytes: int = 0
    level: int = 0
    serves_for: str = ""
    draft: str = ""

    @property
    def value(self) -> float:
        return float(max(self.model.priority, 0)) + 1e-9

    @property
    def cost(self) -> int:
        return max(self.profiles[0].footprint(self.extra_bytes), 1) if self.profiles else 1

    @property
    def key(self) -> tuple:
        return (self.model.id, self.slot)


@dataclasses.dataclass
class Placed:
    demand: Demand
    profile: Profile
    spot: Spot
    replica: ReplicaInfo


def try_place(demand: Demand, fleet: Fleet, quotas: Quotas, placer: Placer) -> tuple[Profile | None, Spot | None, str]:
    first = ""
    for profile in demand.profiles:
        refusal = quotas.refusal(demand.model.owner, need_of(profile, demand.extra_bytes)) if quotas.governed else ""
        if refusal:
            first = first or refusal
            continue
        spot = placer.best_spot(fleet, demand.model, profile, demand.extra_bytes)
        if spot is not None:
            return profile, spot, ""
    return None, None, first


def commit(demand: Demand, profile: Profile, spot: Spot, fleet: Fleet, quotas: Quotas, now: float) -> Placed:
    replica = ReplicaInfo(id=f"plan:{demand.model.id}:{demand.slot}", model=demand.model.id, profile=profile.name,
                          node=spot.node, accelerators=spot.accelerators, memory_bytes=spot.memory_bytes,
                          cpu_cores=spot.cpu_cores, state="starting", pinned=demand.model.pinned, created_at=now,
                          fingerprint=demand.model.fingerprint, load_added=demand.tier == 2 and demand.model.extra > 0)
    fleet.add(replica)
    quotas.add(replica)
    return Placed(demand, profile, spot, replica)


def _greedy(order: Sequence[Demand], fleet: Fleet, quotas: Quotas, placer: Placer, now: float):
    placed, unplaced = [], []
    for demand in order:
        profile, spot, _ = try_place(demand, fleet, quotas, placer)
        if spot is None:
            unplaced.append(demand)
        else:
            placed.append(commit(demand, profile, spot, fleet, quotas, now))
    return placed, unplaced


def _score(placed: Sequence[Placed]) -> tuple:
    return (sum(p.demand.value for p in placed), -sum(p.demand.cost for p in placed))


def pack(demands: Sequence[Demand], fleet: Fleet, quotas: Quotas, placer: Placer, now: float, *,
         exhaustive: bool = True) -> tuple[list[Placed], list[Demand], Fleet, Quotas]:
    """Place ``demands`` on ``fleet`` (mutating the returned fleet/quotas), worth against cost."""
    by_priority = sorted(demands, key=lambda d: (-d.value, -d.cost, d.key))
    trial_fleet, trial_quotas = fleet.copy(), quotas.copy()
    placed, unplaced = _greedy(by_priority, trial_fleet, trial_quotas, placer, now)
    best = (placed, unplaced, trial_fleet, trial_quotas)
    if not unplaced or not exhaustive:
        return best
    if all(try_place(d, fleet, quotas, placer)[1] is None for d in unplaced):
        return best  # what fits nowhere even alone, no order or swap places: the greedy placed the rest
    # Not everything fits: worth against cost. Several orders (worth per byte, worth, and a few
    # deterministic perturbations of worth per byte for small batches), each improved by swaps.
    by_density = sorted(demands, key=lambda d: (-d.value / d.cost, -d.value, d.key))
    orders = [by_priority, by_density, sorted(demands, key=lambda d: (-d.value, d.cost, d.key))]
    if len(demands) <= RESTART_LIMIT:
        rnd = random.Random(len(demands))  # deterministic: the same batch gets the same restarts
        for _ in range(RESTARTS):
            noisy = {d.key: d.value / d.cost * rnd.uniform(0.7, 1.3) for d in demands}
            orders.append(sorted(demands, key=lambda d: (-noisy[d.key], d.key)))
    best = None
    for order in orders:
        trial_fleet, trial_quotas = fleet.copy(), quotas.copy()
        placed, unplaced = _greedy(order, trial_fleet, trial_quotas, placer, now)
        if unplaced:
            placed, unplaced = _improve(placed, unplaced, trial_fleet, trial_quotas, placer, now)
        if best is None or _score(placed) > _score(best[0]):
            best = (placed, unplaced, trial_fleet, trial_quotas)
        if not unplaced:
            break
    if best[1] and len(demands) <= EXACT_DEMANDS and not quotas.governed:
        found = _exact(demands, fleet, placer, best_value=_score(best[0])[0])
        if found is not None:
            trial_fleet, trial_quotas = fleet.copy(), quotas.copy()
            placed, taken = [], set()
            for demand, profile, acc_id, need in found:
                node_name = fleet.acc_node[acc_id]
                placed.append(commit(demand, profile, Spot(node_name, (acc_id,), need, profile.cpu_cores),
                                     trial_fleet, trial_quotas, now))
                taken.add(demand.key)
            rest = [d for d in by_density if d.key not in taken]
            more, unplaced = _greedy(rest, trial_fleet, trial_quotas, placer, now)  # what the search left out
            placed.extend(more)
            if _score(placed) > _score(best[0]):
                best = (placed, unplaced, trial_fleet, trial_quotas)
        # Then re-solve pairs of accelerators, and triples where there are few: a triple can move
        # a large model onto a large accelerator and what was there onto a smaller one, a chain
        # of moves no pair sees (and the greedy orders above tend to miss).
        for size, limit, nodes in ((2, PAIR_ACCELERATORS, PAIR_NODES), (3, TRIPLE_ACCELERATORS, TRIPLE_NODES)):
            if best[1]:
                _repack(best[0], best[1], best[2], best[3], placer, now, size=size, limit=limit, nodes=nodes)
    return best


def _repack(placed: list[Placed], unplaced: list[Demand], fleet: Fleet, quotas: Quotas, placer: Placer,
            now: float, *, size: int, limit: int, nodes: int, rounds: int = 8) -> None:
    """A local search for small batches: for each group of ``size`` accelerators (when there are at
    most ``limit``), take out what this pack placed on them and solve the group exactly with those
    and every demand still unplaced, searching at most ``nodes``; keep a better answer. It stops
    after REPACK_NODES nodes in all. Residents stay where they are. Changes ``placed``,
    ``unplaced``, ``fleet``, ``quotas`` in place."""
    accs = sorted({p.spot.accelerators[0] for p in placed if len(p.spot.accelerators) == 1})
    others = sorted(a for a in fleet.free_acc if a not in accs and fleet.free_acc[a] > 0)
    accs = sorted(set(accs) | set(others))
    if len(accs) > limit or len(accs) < size:
        return
    meter = [REPACK_NODES]
    for _ in range(rounds):
        improved = False
        for group in itertools.combinations(accs, size):
            if not unplaced or meter[0] <= 0:
                return
            only = set(group)
            inside = [p for p in placed if len(p.spot.accelerators) == 1 and p.spot.accelerators[0] in only]
            trial = fleet.copy()
            for p in inside:
                trial.remove(p.replica.id)
            found = _exact([p.demand for p in inside] + list(unplaced), trial, placer,
                           best_value=sum(p.demand.value for p in inside), only=only,
                           nodes=min(nodes, meter[0]), meter=meter)
            if found is None:
                continue
            for p in inside:
                fleet.remove(p.replica.id)
                quotas.remove(p.replica)
                placed.remove(p)
            keys = set()
            for demand, profile, acc_id, need in found:
                placed.append(commit(demand, profile, Spot(fleet.acc_node[acc_id], (acc_id,), need,
                                                           profile.cpu_cores), fleet, quotas, now))
                keys.add(demand.key)
            pool = [d for d in unplaced if d.key not in keys] + [p.demand for p in inside if p.demand.key not in keys]
            unplaced[:] = sorted(pool, key=lambda d: (-d.value / d.cost, -d.value, d.key))
            improved = True
        if not improved:
            return


def _exact(demands: Sequence[Demand], fleet: Fleet, placer: Placer, best_value: float, *,
           only: set[str] | None = None, nodes: int = EXACT_NODES, meter: list[int] | None = None):
    """A bounded branch and bound over single-accelerator placements of a small batch: each demand
    (by worth per byte) goes on one of the accelerators that can take it, or is left out; the bound
    is a fractional knapsack of what is left over the free memory left, counting for each demand
    only the accelerators it still fits on (see ``bound``). Returns the best assignment found worth
    more than ``best_value`` — [(demand, profile, accelerator, bytes)] — or None. The node budget is
    a count, not a time, so the answer is the same on every run; ``meter``, when given, is charged
    the nodes used."""
    options_of: dict[tuple, list[tuple]] = {}
    acc_ids: set[str] = set()
    cores_used = False
    for demand in demands:
        mine = []
        for profile in demand.profiles:
            if profile.gpus != 1:
                continue
            need = profile.memory_bytes + demand.extra_bytes
            holds_key = demand.model.weights_key
            cards = fleet.cards_used(demand.model.id)
            for node in fleet.nodes.values():
                usable = placer.usable(node, profile)
                if not usable:
                    continue
                holds = bool(holds_key) and holds_key in node.weights
                if profile.min_disk_bytes and not holds and node.disk_free_bytes is not None \
                        and node.disk_free_bytes < profile.min_disk_bytes:
                    continue
                for acc_id in usable:
                    if only is not None and acc_id not in only:
                        continue
                    if acc_id in fleet.mig_used or fleet.free_acc.get(acc_id, -1) < need:
                        continue
                    if fleet.card_of(acc_id) in cards:
                        continue  # spread: the model already runs on this GPU
                    mine.append((profile, acc_id, need, profile.cpu_cores))
                    acc_ids.add(acc_id)
                    cores_used = cores_used or bool(profile.cpu_cores)
        options_of[demand.key] = mine

    def smallest(d: Demand) -> int:
        return max(min((o[2] for o in options_of[d.key]), default=1), 1)

    # Worth per byte of the smallest way to place it: the order the fractional bound needs.
    order = sorted(demands, key=lambda d: (-d.value / smallest(d), -d.value, d.key))
    options = [options_of[d.key] for d in order]
    if len(acc_ids) > EXACT_ACCELERATORS:
        return None
    free = {a: fleet.free_acc[a] for a in sorted(acc_ids)}
    mig = {a for a in free if fleet.acc_info[a].mig}
    card = {a: fleet.card_of(a) for a in free}
    busy: set[tuple[str, str]] = set()  # (model, card) taken in the branch being searched: spread
    cores = dict(fleet.free_cores)
    # Which demands may use each accelerator: two with equal free room and equal users are interchangeable.
    users: dict[str, tuple] = {a: () for a in free}
    for i, mine in enumerate(options):
        for _, acc_id, _, _ in mine:
            users[acc_id] += (i,)
    values = [d.value for d in order]
    sizes = [smallest(d) for d in order]
    n = len(order)
    best = {"value": best_value + 1e-9, "assign": None}
    chosen: list = [None] * n
    budget = [nodes]
    # With whole priorities of 1 or more, an answer is worth a whole number (plus 1e-9 a
    # placement, a tie-break), so a branch must be able to reach the next whole number above the
    # best found: a bound of 112.7 against a best of 112 prunes, where comparing fractions would
    # search on. Priority 0 is worth only the 1e-9, so such a batch compares fractions.
    whole = all(v >= 1 and abs(v - round(v)) < 1e-6 for v in values)
    least = [0] * (n + 1)  # the smallest demand from i on: rooms below it take nothing
    least[n] = math.inf
    for i in range(n - 1, -1, -1):
        least[i] = min(least[i + 1], sizes[i] if options[i] else math.inf)

    def bound(i: int, value: float) -> float:
        """What demands i, i + 1, … could add at most: by worth per byte they fill the free room
        fractionally, but a demand counts only room on accelerators it still fits on. With room
        sizes t1 > t2 > …, the demands that fit only where there is at least tk share at most the
        room of those accelerators; filling these nested limits in worth-per-byte order is the
        optimum of that relaxation. Leftover room too small for what is left counts for nothing,
        which a bound on the total free room alone cannot see (and most of the search happens
        where accelerators are nearly full)."""
        rooms = sorted((v for a, v in free.items() if v >= least[i] and (a not in mig or v == fleet.free_acc[a])),
                       reverse=True)
        if not rooms:
            return value
        tops, left, total = [], [], 0  # left[k]: what the rooms of at least tops[k] can still take
        for r in rooms:
            total += r
            if tops and tops[-1] == r:
                left[-1] = total
            else:
                tops.append(r)
                left.append(total)
        ascending, m = tops[::-1], len(tops)
        for j in range(i, n):
            size = sizes[j]
            if size > tops[0] or not options[j]:
                continue
            k = m - bisect.bisect_left(ascending, size)  # it fits where there is at least tops[k - 1]
            take = min(size, min(left[k - 1:]))
            if take <= 0:
                continue
            for q in range(k - 1, m):
                left[q] -= take
            value += values[j] * take / size
            if left[-1] <= 0:
                break
        return value

    def beaten(i: int, value: float) -> bool:
        top = bound(i, value)
        if whole:
            return math.floor(top + 1e-6) <= math.floor(best["value"] + 1e-6)
        return top <= best["value"]

    def search(i: int, value: float) -> None:
        if budget[0] <= 0:
            return
        budget[0] -= 1
        if i == n:
            if value > best["value"]:
                best["value"], best["assign"] = value, list(chosen)
            return
        if beaten(i, value):
            return
        seen = set()
        model_id = order[i].model.id
        for option in sorted(options[i], key=lambda o: (free[o[1]], o[1])):
            profile, acc_id, need, cpu = option
            node_name = fleet.acc_node[acc_id]
            if free[acc_id] < need or (acc_id in mig and free[acc_id] != fleet.free_acc[acc_id]):
                continue
            if cpu and cores.get(node_name) is not None and cores[node_name] < cpu:
                continue
            if (model_id, card[acc_id]) in busy:
                continue
            # Whole GPUs alike in free room and users are interchangeable, spread included (each is
            # its own card); MIG instances of different cards are not (their siblings differ).
            same = (profile.name, free[acc_id], acc_id in mig, users[acc_id], node_name if cores_used else "",
                    card[acc_id] if acc_id in mig else "")
            if same in seen:
                continue
            seen.add(same)
            free[acc_id] -= need
            if cpu and cores.get(node_name) is not None:
                cores[node_name] -= cpu
            chosen[i] = option
            busy.add((model_id, card[acc_id]))
            search(i + 1, value + values[i])
            busy.discard((model_id, card[acc_id]))
            chosen[i] = None
            free[acc_id] += need
            if cpu and cores.get(node_name) is not None:
                cores[node_name] += cpu
        search(i + 1, value)

    search(0, 0.0)
    if meter is not None:
        meter[0] -= nodes - budget[0]  # what a caller with a budget of its own has left
    if best["assign"] is None:
        return None
    return [(order[i], o[0], o[1], o[2]) for i, o in enumerate(best["assign"]) if o is not None]


def _improve(placed: list[Placed], unplaced: list[Demand], fleet: Fleet, quotas: Quotas, placer: Placer,
             now: float, rounds: int = 64) -> tuple[list[Placed], list[Demand]]:
    """Swap placements made in this pack (never resident replicas) out for a more valuable demand
    on one accelerator, re-placing what was swapped out where it still fits."""
    for _ in range(rounds):
        improved = False
        on_acc: dict[str, list[Placed]] = {}
        for p in placed:
            if len(p.spot.accelerators) == 1:
                on_acc.setdefault(p.spot.accelerators[0], []).append(p)
        for demand in sorted(unplaced, key=lambda d: (-d.value / d.cost, -d.value, d.key)):
            best = None
            for profile in demand.profiles:
                if profile.gpus != 1:
                    continue
                need = profile.memory_bytes + demand.extra_bytes
                for acc_id in sorted(on_acc):
                    node = fleet.nodes[fleet.acc_node[acc_id]]
                    if acc_id not in placer.usable(node, profile):
                        continue
                    if fleet.card_of(acc_id) in fleet.cards_used(demand.model.id):
                        continue  # spread: never a second replica of the model on this GPU
                    free = fleet.free_acc.get(acc_id, 0)
                    out, gained, lost = [], free, 0.0
                    mig = fleet.acc_info[acc_id].mig
                    if mig and len(on_acc[acc_id]) != sum(1 for r in fleet.replicas.values() if acc_id in r.accelerators):
                        continue  # a resident replica holds this MIG instance
                    for p in sorted(on_acc[acc_id], key=lambda p: (p.demand.value / p.demand.cost, p.demand.key)):
                        if gained >= need and not mig:
                            break
                        out.append(p)
                        gained += p.replica.memory_bytes
                        lost += p.demand.value
                    if gained < need or lost >= demand.value:
                        continue
                    gain = demand.value - lost
                    key = (-gain, gained - need, acc_id)
                    if best is None or key < best[0]:
                        best = (key, profile, acc_id, out, need)
            if _shift(demand, placed, on_acc, fleet, quotas, placer, now):
                unplaced.remove(demand)
                improved = True
                break
            if best is None:
                continue
            _, profile, acc_id, out, need = best
            trial_fleet, trial_quotas = fleet.copy(), quotas.copy()
            for p in out:
                trial_fleet.remove(p.replica.id)
                trial_quotas.remove(p.replica)
            if quotas.governed and trial_quotas.refusal(demand.model.owner, need_of(profile, demand.extra_bytes)):
                continue
            node_name = fleet.acc_node[acc_id]
            spot = Spot(node_name, (acc_id,), need, profile.cpu_cores)
            # Commit the swap on the real working copies.
            for p in out:
                fleet.remove(p.replica.id)
                quotas.remove(p.replica)
                placed.remove(p)
            placed.append(commit(demand, profile, spot, fleet, quotas, now))
            unplaced.remove(demand)
            unplaced.extend(p.demand for p in out)
            more, unplaced = _greedy(sorted(unplaced, key=lambda d: (-d.value / d.cost, -d.value, d.key)),
                                     fleet, quotas, placer, now)
            placed.extend(more)
            improved = True
            break
        if not improved:
            break
    return placed, unplaced


def _shift(demand: Demand, placed: list[Placed], on_acc: dict, fleet: Fleet, quotas: Quotas, placer: Placer,
           now: float) -> bool:
    """Make room for ``demand`` on one accelerator by moving one placement of this pack to another
    accelerator where it fits: nothing is lost, the demand is gained."""
    for profile in demand.profiles:
        if profile.gpus != 1 or (quotas.governed and quotas.refusal(demand.model.owner, need_of(profile, demand.extra_bytes))):
            continue
        need = profile.memory_bytes + demand.extra_bytes
        for acc_id in sorted(on_acc):
            node = fleet.nodes[fleet.acc_node[acc_id]]
            if fleet.acc_info[acc_id].mig or acc_id not in placer.usable(node, profile):
                continue
            free = fleet.free_acc.get(acc_id, 0)
            # Spread: the demand's model may be on this (whole) GPU only as the placement moved away.
            mine = fleet.cards_used(demand.model.id).get(fleet.card_of(acc_id), 0)
            for p in sorted(on_acc[acc_id], key=lambda p: (p.replica.memory_bytes, p.demand.key)):
                if free + p.replica.memory_bytes < need:
                    continue
                if mine - (p.replica.model == demand.model.id) > 0:
                    continue
                moved = p.replica.memory_bytes
                target = None
                for other in sorted(fleet.free_acc, key=lambda a: (fleet.free_acc[a], a)):
                    if other == acc_id or fleet.free_acc[other] < moved or fleet.acc_info[other].mig:
                        continue
                    if fleet.card_of(other) in fleet.cards_used(p.replica.model):
                        continue  # spread, for the placement moved
                    other_node = fleet.nodes[fleet.acc_node[other]]
                    if p.profile.gpus != 1 or other not in placer.usable(other_node, p.profile):
                        continue
                    target = other
                    break
                if target is None:
                    continue
                fleet.remove(p.replica.id)
                quotas.remove(p.replica)
                placed.remove(p)
                placed.append(commit(p.demand, p.profile, Spot(fleet.acc_node[target], (target,), moved, p.spot.cpu_cores),
                                     fleet, quotas, now))
                placed.append(commit(demand, profile, Spot(node.name, (acc_id,), need, profile.cpu_cores),
                                     fleet, quotas, now))
                return True
    return False
