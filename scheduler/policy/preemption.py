"""Capacity classes and preemption: which replicas may give room to a model that does not fit.

Tiers (lowest first): 0 idle on-demand replicas of lower classes; 1 replicas borrowed beyond their
owner's guarantee while the requester is within its own; 2 lower-class replicas above their
minimum; 3 same-class replicas above their minimum when the requester is below its minimum;
4 lower-class minimums (never a critical minimum). Never a pinned or active replica, one within
its owner's guarantee for a different owner, one ready for less than the minimum lifetime, or one
spanning several nodes. Victims are added in order (at most ``max_victims``) until a dry run on a
copy places the model, then pruned to a minimal set; when the global order spreads them over
places that each stay too small, the order is followed within one place at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from scheduler.policy.inputs import CRITICAL, DesiredModel, ReplicaInfo, Settings
from scheduler.policy.placement import Fleet
from scheduler.policy.quotas import Quotas


@dataclasses.dataclass(frozen=True)
class Candidate:
    tier: int
    replica: ReplicaInfo

    def key(self, now: float):
        r = self.replica
        idle = (now - r.last_used_at) if r.last_used_at is not None else 0.0
        return (self.tier, -idle, len(r.accelerators), r.memory_bytes * max(len(r.accelerators), 1), r.id)


def candidates(requester: DesiredModel, requester_below_min: bool, need: tuple, fleet: Fleet,
               models: Mapping[str, DesiredModel], desired: Mapping[str, int], quotas: Quotas, now: float,
               settings: Settings, borrowed: set[str], protected: Callable[[ReplicaInfo], bool],
               room_for_on_demand: bool = False) -> list[Candidate]:
    by_model: dict[str, list[ReplicaInfo]] = {}
    for replica in fleet.replicas.values():
        if replica.model != requester.id:
            by_model.setdefault(replica.model, []).append(replica)
    requester_guaranteed = quotas.guaranteed(requester.owner, need)
    starved = requester.waiting_since is not None and now - requester.waiting_since >= settings.starved_after_s
    found = []
    for model_id in sorted(by_model):
        model = models.get(model_id)
        if model is None:
            continue  # not desired: the surplus step removes those
        # Newest first; only ready replicas count toward "above minimum", so a model whose new
        # replicas are still starting does not expose its older ones (and a plan stays a fixed point).
        replicas = sorted((r for r in by_model[model_id] if r.ready_since is not None),
                          key=lambda r: (-r.created_at, r.id))
        above = max(0, len(replicas) - model.scaling.min)
        lower = model.rank < requester.rank
        same = model.rank == requester.rank
        for position, replica in enumerate(replicas):
            if protected(replica) or replica.spans_nodes:
                continue
            if replica.ready_since is None or now - replica.ready_since < settings.min_lifetime_s:
                continue
            owner = model.owner
            if owner != requester.owner and quotas.has_guarantee(owner) and replica.id not in borrowed:
                continue  # guarantee protection beats class
            is_above = position < above
            critical_min = model.effective_class == CRITICAL and not is_above
            if critical_min:
                continue
            idle = replica.last_used_at is not None and now - replica.last_used_at >= settings.eviction_grace_s
            if model.scaling.on_demand and idle and (lower or (same and room_for_on_demand
                                                             and (model.priority <= requester.priority or starved))):
                # Idle on-demand replicas: of lower classes; to load an on-demand model, also those of
                # its class worth no more than it (a rarely used model does not push out a busy one),
                # and any of its class once its requests have waited long (no load starves).
                tier = 0
            elif replica.id in borrowed and requester_guaranteed:
                tier = 1
            elif lower and is_above:
                tier = 2
            elif same and is_above and requester_below_min:
                tier = 3
            elif lower and not is_above:
                tier = 4
            else:
                continue
            found.append(Candidate(tier, replica))
    found.sort(key=lambda c: c.key(now))
    return found


PLACES_TRIED = 32  # dry runs on single places when the global order fails (a count: deterministic)


def choose(pool: Sequence[Candidate], fleet: Fleet, fits: Callable[[Fleet], bool],
           max_victims: int) -> tuple[list[Candidate], Fleet | None]:
    """The minimal victim set (in order) that lets ``fits`` succeed on a copy, or ``([], None)``.

    The pool's order is global, so its first ``max_victims`` may sit on as many accelerators, none
    of which then has room: stopping three small idle replicas on three GPUs frees no GPU for a
    large model. When the global order fails, the same order is tried within one place at a time
    (an accelerator, or a node for tensor-parallel and CPU replicas), the places whose candidates
    come first in the order first; the answer is the set with the lowest tiers, then the fewest
    victims, then the earliest in the order."""
    chosen, trial = _in_order(pool, fleet, fits, max_victims)
    if trial is not None:
        return chosen, trial
    position = {id(c): i for i, c in enumerate(pool)}
    places: dict[tuple, list[Candidate]] = {}
    for candidate in pool:
        replica = candidate.replica
        for acc in replica.accelerators:
            places.setdefault(("accelerator", acc), []).append(candidate)
        places.setdefault(("node", replica.node), []).append(candidate)
    ranked = sorted(places.items(), key=lambda item: ([position[id(c)] for c in item[1][:max_victims]], item[0]))
    best = None
    for _, members in ranked[:PLACES_TRIED]:
        chosen, trial = _in_order(members, fleet, fits, max_victims)
        if trial is None:
            continue
        key = (max(c.tier for c in chosen), len(chosen), sorted(position[id(c)] for c in chosen))
        if best is None or key < best[0]:
            best = (key, chosen, trial)
    return (best[1], best[2]) if best is not None else ([], None)


def _in_order(pool: Sequence[Candidate], fleet: Fleet, fits: Callable[[Fleet], bool],
              max_victims: int) -> tuple[list[Candidate], Fleet | None]:
    chosen: list[Candidate] = []
    trial = fleet.copy()
    for candidate in pool:
        if len(chosen) >= max_victims:
            break
        chosen.append(candidate)
        trial.remove(candidate.replica.id)
        if fits(trial):
            break
    else:
        return [], None
    if not chosen or not fits(trial):
        return [], None
    # Prune: walking back from the last added, drop each victim whose removal still leaves a fit.
    for candidate in list(reversed(chosen[:-1])):
        again = fleet.copy()
        for other in chosen:
            if other is not candidate:
                again.remove(other.replica.id)
        if fits(again):
            chosen.remove(candidate)
    final = fleet.copy()
    for candidate in chosen:
        final.remove(candidate.replica.id)
    return chosen, final
