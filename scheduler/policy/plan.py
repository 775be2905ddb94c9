"""``schedule(snapshot) -> Plan``: the placement policy's one entry point.

Deterministic and idempotent: a converged state yields an empty plan, and applying a plan
(launches become starting replicas, evictions disappear, holds are carried) then scheduling again
yields nothing new. Steps: recovery and parking; desired counts; evictions of what is not desired
or surplus (never pinned or active replicas); replicas leaving — on a draining node, or the next of
a rolling restart — stop once as many replicas elsewhere are ready as the model wants, and until then
are replaced like missing ones; placement of what is missing in tiers — pinned, below minimum, the
rest — with a cost-aware packer; preemption for pinned and below-minimum demands that did not fit (a
replacement preempts nothing unless pinned); a last fill; unschedulable models with their first
reason; evidence per model.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from scheduler.policy import preemption, recovery
from scheduler.policy.inputs import (
    Decision, DesiredModel, Eviction, Hold, Launch, Move, Plan, ReplicaInfo, Snapshot, Unschedulable, Wake,
)
from scheduler.policy.placement import Fleet, Placer, constraint_refusal, draft_bytes, ordered_profiles
from scheduler.policy.quotas import Quotas, need_of, replica_need
from scheduler.policy.residency import Demand, Placed, commit, desired_count, pack, surplus, try_place


def _protected(models: dict[str, DesiredModel]):
    def check(replica: ReplicaInfo) -> bool:
        model = models.get(replica.model)
        return replica.pinned or replica.active_requests > 0 or bool(model and model.pinned)
    return check


def schedule(snapshot: Snapshot, *, only: Iterable[str] | None = None) -> Plan:
    now, settings = snapshot.now, snapshot.settings
    models = {m.id: m for m in sorted(snapshot.models, key=lambda m: m.id)}
    replicas = sorted((r for r in snapshot.replicas if r.state != ASLEEP), key=lambda r: r.id)
    # Sleeping replicas serve nothing and hold no device memory: only their host memory counts, until
    # one is woken (step 2) or stopped (step 1).
    asleep = sorted((r for r in snapshot.replicas if r.state == ASLEEP), key=lambda r: r.id)
    by_model: dict[str, list[ReplicaInfo]] = {}
    for replica in replicas:
        by_model.setdefault(replica.model, []).append(replica)
    protected = _protected(models)
    fleet = Fleet(snapshot.nodes, replicas + [host_share(r) for r in asleep])
    quotas = Quotas(snapshot.contracts, {m.id: m.owner for m in models.values()}, replicas)
    placer = Placer()
    decisions: list[Decision] = []
    evictions: list[Eviction] = []
    unschedulable: list[Unschedulable] = []

    desired: dict[str, int] = {}
    bases: dict[str, int] = {}
    for model in models.values():
        desired[model.id], bases[model.id], _ = desired_count(model, by_model.get(model.id, []), now)

    def ready_count(model_id: str) -> int:
        return sum(1 for r in by_model.get(model_id, []) if r.ready_since is not None)

    holds = {}
    for hold in sorted(snapshot.holds, key=lambda h: (h.model, h.until)):
        satisfied = hold.beneficiary in desired and ready_count(hold.beneficiary) >= desired[hold.beneficiary]
        if hold.until > now and not satisfied:
            holds[hold.model] = hold

    def evict(model_id: str, victims: list[ReplicaInfo], reason: str, detail: str, may_sleep: bool = False) -> None:
        stopped = []
        for victim in victims:
            fleet.remove(victim.id)
            quotas.remove(victim)
            why_asleep = try_sleep(victim, models.get(model_id), fleet, settings, now) if may_sleep else ""
            evictions.append(Eviction(replica=victim.id, model=model_id, reason=reason, sleep=bool(why_asleep)))
            if why_asleep:
                decisions.append(Decision(model=model_id, verdict="evicted", codes=(reason, "sleep"),
                                          node=victim.node, victims=(victim.id,), detail=f"{reason}: {why_asleep}"))
            else:
                stopped.append(victim)
        if stopped:
            decisions.append(Decision(model=model_id, verdict="evicted", codes=(reason,),
                                      victims=tuple(v.id for v in stopped), detail=detail))

    # 0. Sleeping replicas of models gone, asleep unasked past the sleep window, or on a draining node
    # are stopped.
    for replica in asleep:
        model = models.get(replica.model)
        why = asleep_too_long(replica, model, snapshot, settings)
        if why:
            fleet.remove(host_share(replica).id)
            evictions.append(Eviction(replica=replica.id, model=replica.model, reason=why))
            decisions.append(Decision(model=replica.model, verdict="evicted", codes=(why,), node=replica.node,
                                      victims=(replica.id,), detail=f"stopped asleep: {ASLEEP_STOPPED[why]}"))
    sleeping = {r.id for r in asleep} - {e.replica for e in evictions}

    # 1. Evictions: replicas of models no longer desired, and surplus above the desired count among
    # those not leaving (a draining node's, a rolling restart's next: step 6 decides when they stop).
    leaving = leaving_replicas(snapshot, models, by_model)
    staying: dict[str, list[ReplicaInfo]] = {}
    going: list[ReplicaInfo] = []  # leaving replicas of catalog models
    moves: list[Move] = []
    wakes: list[Wake] = []
    for model_id in sorted(by_model):
        mine = by_model[model_id]
        model = models.get(model_id)
        if model is None:
            victims = [r for r in mine if not protected(r)]
            evict(model_id, victims, "not-desired", f"{len(victims)} replica(s) stopped: not-desired")
            moves.extend(Move(r.id, model_id, r.node, leaving[r.id], "blocked", NOT_PLACED_HERE)
                         for r in mine if r.id in leaving and r not in victims)
            continue
        idle = model.scaling.on_demand and bases[model_id] == 0
        reason = "idle" if idle else "surplus"
        kept = [r for r in mine if r.id not in leaving]
        victims = surplus(kept, desired[model_id], now, protected=protected,
                          idle_only_after=model.scaling.idle_timeout_s if idle else None)
        # Going idle frees room like making room does: a replica that can sleep sleeps (a surplus stops).
        evict(model_id, victims, reason, f"{len(victims)} replica(s) stopped: {reason}", may_sleep=idle)
        staying[model_id] = [r for r in kept if r not in victims]
        # Replaced like missing ones; whether they stop is decided last (after preemption, which
        # may take a replica that would have stood in for one).
        going.extend(r for r in mine if r.id in leaving)

    # 2. Demands: what is missing, unless parked, held back or backing off.
    demands: list[Demand] = []
    for model in models.values():
        if only is not None and model.id not in only:
            continue
        have = len(staying.get(model.id, ()))
        missing = desired[model.id] - have
        if missing <= 0:
            continue
        replacing = have + sum(1 for r in going if r.model == model.id)  # slots below this stand in for leaving ones
        step = recovery.next_step(model, snapshot.failures.get(model.id), settings, known=models)
        if step.parked:
            unschedulable.append(Unschedulable(model.id, step.reason, "parked", missing))
            decisions.append(Decision(model.id, "parked", ("parked",), detail=step.reason))
            continue
        if model.id in holds:
            hold = holds[model.id]
            beneficiary = models.get(hold.beneficiary)
            named = _named_to(beneficiary, model) if beneficiary is not None else "a model since removed"
            why = f"held back until {hold.until:.0f} after giving room to {named}"
            unschedulable.append(Unschedulable(model.id, why, "held", missing))
            decisions.append(Decision(model.id, "held", ("held",), detail=why))
            continue
        if step.not_before is not None and step.not_before > now:
            why = f"backing off after a {snapshot.failures[model.id].kind} until {step.not_before:.0f}"
            unschedulable.append(Unschedulable(model.id, why, "backoff", missing))
            decisions.append(Decision(model.id, "backoff", ("backoff",), detail=why))
            continue
        # A sleeping replica whose GPUs have room again is woken before a new one is launched.
        for replica in [r for r in asleep if r.id in sleeping and r.model == model.id][:missing]:
            why = wakes_there(replica, model, fleet, quotas)
            if why:
                continue
            sleeping.discard(replica.id)
            fleet.remove(host_share(replica).id)
            awake = dataclasses.replace(replica, state="starting", ready_since=None)
            fleet.add(awake)
            quotas.add(awake)
            staying.setdefault(model.id, []).append(awake)
            wakes.append(Wake(replica.id, model.id, replica.node, reason=f"woken for {demand_reason(model)}"))
            decisions.append(Decision(model.id, "placed", ("wake",), node=replica.node,
                                      accelerators=replica.accelerators,
                                      detail=f"woken on {replica.node} (a wake takes seconds, a load far longer)"))
            have, missing = have + 1, missing - 1
        if missing <= 0:
            continue
        source, serves_for = model, ""
        if step.fallback:
            substitute = models[recovery.usable_fallbacks(model.id, model.fallbacks, models)[0]]  # the step exists only when one does
            source, serves_for = substitute, substitute.id
        if step.level >= recovery.MINIMAL_FOOTPRINT and source.minimal:
            source = dataclasses.replace(source, profiles=source.minimal)  # the last rung's footprint
        profiles = tuple(ordered_profiles(source))
        for slot in range(missing):
            index = have + slot
            if model.pinned:
                tier, why = 0, "pinned"
            elif index < replacing:
                tier, why = 2, "replacement"  # moving preempts nothing: the old replica still serves
            elif index < bases[model.id]:
                tier, why = 1, ("on-demand" if model.scaling.on_demand else "minimum")
            else:
                tier, why = 2, "load" if model.extra else "desired"
            demands.append(Demand(model=model, slot=index, tier=tier, reason=why, profiles=profiles,
                                  extra_bytes=draft_bytes(source), level=step.level, serves_for=serves_for,
                                  draft=source.draft.model if source.draft else ""))

    # 3. Placement, tier by tier, with the cost-aware packer.
    placed: list[Placed] = []
    unplaced: list[Demand] = []
    exhaustive = len(demands) <= settings.exhaustive_packing_limit
    for tier in (0, 1, 2):
        batch = [d for d in demands if d.tier == tier]
        if not batch:
            continue
        done, left, fleet, quotas = pack(batch, fleet, quotas, placer, now, exhaustive=exhaustive)
        placed.extend(done)
        unplaced.extend(left)

    # 4. Preemption for pinned and below-minimum demands that did not fit.
    new_holds: list[Hold] = []
    victims_of: dict[tuple, list[str]] = {}
    borrowed = quotas.borrowed(fleet.replicas.values()) if quotas.governed else set()
    progress = True
    while progress:
        progress = False
        for demand in sorted([d for d in unplaced if d.tier <= 1],
                             key=lambda d: (-d.model.rank, d.tier, -d.value, d.key)):
            model = demand.model
            if demand.reason == "on-demand" and model.waiting_batch_only:
                continue  # batch work uses only the room interactive work leaves
            need = need_of(demand.profiles[0], demand.extra_bytes) if demand.profiles else (0, 0, 0)
            below_min = demand.slot < max(model.scaling.min, 1 if model.pinned else 0)
            pool = preemption.candidates(model, below_min, need, fleet, models, desired, quotas, now, settings,
                                         borrowed, protected, room_for_on_demand=demand.reason == "on-demand" and model.waiting > 0)
            if not pool:
                continue
            quota_base = quotas

            def fits(trial: Fleet) -> bool:
                for profile in demand.profiles:
                    if placer.best_spot(trial, model, profile, demand.extra_bytes) is not None:
                        return True
                return False

            chosen, trial = preemption.choose(pool, fleet, fits, settings.max_victims)
            if trial is None:
                continue
            trial_quotas = quota_base.copy()
            for c in chosen:
                trial_quotas.remove(c.replica)
            profile, spot, _ = try_place(demand, trial, trial_quotas, placer)
            if spot is None:
                continue
            fleet, quotas = trial, trial_quotas
            placed.append(commit(demand, profile, spot, fleet, quotas, now))  # first: a victim asleep keeps host memory
            for c in chosen:
                victim_model = models[c.replica.model]
                why_asleep = try_sleep(c.replica, victim_model, fleet, settings, now)
                evictions.append(Eviction(replica=c.replica.id, model=c.replica.model, reason="preempted",
                                          grace_s=settings.preempt_grace_s, beneficiary=model.id, tier=c.tier,
                                          sleep=bool(why_asleep)))
                new_holds.append(Hold(model=victim_model.id, until=now + settings.preempt_hold_s,
                                      beneficiary=model.id))
                codes = (f"preempted-tier-{c.tier}",) + (("sleep",) if why_asleep else ())
                decisions.append(Decision(victim_model.id, "preempted", codes,
                                          node=c.replica.node, accelerators=c.replica.accelerators,
                                          victims=(c.replica.id,),
                                          detail=f"gave room to {_named_to(model, victim_model)}"
                                                 + (f"; {why_asleep}" if why_asleep else "")))
            victims_of[demand.key] = [c.replica.id for c in chosen]
            unplaced.remove(demand)
            progress = True
            break  # the fleet changed: recompute candidates from the top

    # 5. A last fill: what preemption freed may fit others now.
    while unplaced:
        changed = False
        for demand in sorted(unplaced, key=lambda d: (d.tier, -d.value, d.key)):
            profile, spot, _ = try_place(demand, fleet, quotas, placer)
            if spot is not None:
                placed.append(commit(demand, profile, spot, fleet, quotas, now))
                unplaced.remove(demand)
                changed = True
        if not changed:
            break

    # 6. Leaving replicas stop once enough others are ready to stand in for them; the ready ones are
    # kept longest (they serve meanwhile). A leaving replica preemption took is gone already.
    going_of: dict[str, list[ReplicaInfo]] = {}
    for replica in going:
        if replica.id in fleet.replicas:
            going_of.setdefault(replica.model, []).append(replica)
    held: list[ReplicaInfo] = []  # leaving replicas kept until enough replacements are ready
    for model_id in sorted(going_of):
        mine = sorted(going_of[model_id], key=lambda r: (r.ready_since is None, r.created_at, r.id))
        standing_in = sum(1 for r in staying[model_id] if r.id in fleet.replicas and r.ready_since is not None)
        keep = max(0, desired[model_id] - standing_in)
        for why in ("drain", "restart"):
            done = [r for r in mine[keep:] if leaving[r.id] == why]
            evict(model_id, done, MOVED[why], f"{len(done)} replica(s) stopped: {MOVE_DONE[why]}")
            moves.extend(Move(r.id, model_id, r.node, why, "stopping", MOVE_DONE[why]) for r in done)
        held.extend(mine[:keep])

    launches = []
    for p in sorted(placed, key=lambda p: p.demand.key):
        d = p.demand
        launches.append(Launch(model=d.model.id, profile=p.profile.name, node=p.spot.node,
                               accelerators=p.spot.accelerators, memory_bytes=p.spot.memory_bytes,
                               cpu_cores=p.spot.cpu_cores, level=d.level, serves_for=d.serves_for, draft=d.draft,
                               reason=d.reason, beneficiary_of=tuple(victims_of.get(d.key, ()))))
        codes = (d.reason,) + (("preemption",) if d.key in victims_of else ())
        decisions.append(Decision(d.model.id, "placed", codes, node=p.spot.node, accelerators=p.spot.accelerators,
                                  victims=tuple(victims_of.get(d.key, ())),
                                  detail=f"profile {p.profile.name} on {p.spot.node}"))

    missing_by_model: dict[str, list[Demand]] = {}
    for demand in unplaced:
        missing_by_model.setdefault(demand.model.id, []).append(demand)
    for model_id in sorted(missing_by_model):
        group = missing_by_model[model_id]
        reason, code = first_reason(group[0], fleet, quotas, placer, missing=len(group))
        if group[0].reason == "on-demand" and group[0].model.waiting_batch_only:
            reason += "; only batch requests wait for it, so nothing running is preempted to make room"
        unschedulable.append(Unschedulable(model_id, reason, code, len(group)))
        decisions.append(Decision(model_id, "unschedulable", (code,), detail=reason))

    blocked = {u.model: u.reason for u in unschedulable}
    for replica in held:
        why = leaving[replica.id]
        if replica.model in blocked:
            state, detail = "blocked", f"cannot be moved: {blocked[replica.model]}"
        else:
            state, detail = "waiting", "waits for its replacement to be ready"
        moves.append(Move(replica.id, replica.model, replica.node, why, state, detail))
        decisions.append(Decision(replica.model, "moving", (why, state), node=replica.node,
                                  accelerators=replica.accelerators, victims=(replica.id,),
                                  detail=f"{MOVE_NAMES[why]}: {detail}"))

    all_holds = tuple(sorted(set(holds.values()) | set(new_holds), key=lambda h: (h.model, h.until, h.beneficiary)))
    return Plan(launches=tuple(launches), evictions=tuple(sorted(evictions, key=lambda e: e.replica)),
                unschedulable=tuple(sorted(unschedulable, key=lambda u: u.model)), holds=all_holds,
                decisions=tuple(sorted(decisions, key=lambda d: (d.model, d.verdict, d.node, d.victims))),
                inputs_digest="", moves=tuple(sorted(moves, key=lambda m: (m.node, m.model, m.replica))),
                wakes=tuple(sorted(wakes, key=lambda w: w.replica)))


# --- sleep as a residency tier ------------------------------------------------------------------------

ASLEEP = "sleeping"
ASLEEP_STOPPED = {"not-desired": "its model is no longer in the catalog",
                  "idle": "not asked for within the sleep window", "drained": "its node is draining"}


def host_share(replica: ReplicaInfo) -> ReplicaInfo:
    """A sleeping replica as the fleet counts it: its host memory on its node, no device memory, and
    none of its model's spread (it serves nothing)."""
    return ReplicaInfo(id=f"asleep:{replica.id}", model=f"asleep:{replica.model}", profile="", node=replica.node,
                       memory_bytes=replica.sleep_host_bytes, pinned=True)


def try_sleep(replica: ReplicaInfo, model: DesiredModel | None, fleet: Fleet, settings, now: float) -> str:
    """Put ``replica``, being evicted, to sleep rather than stop it, when it can sleep, its model was
    asked for within the sleep window (so it is likely asked again soon), and its node's host memory
    has room for what it keeps there: that host memory is then counted in ``fleet``, and the answer
    says why. "" to stop it."""
    if not replica.sleep_host_bytes or model is None or not replica.accelerators:
        return ""
    if model.last_requested_at is None or now - model.last_requested_at >= settings.sleep_window_s:
        return ""
    free = fleet.free_ram.get(replica.node)
    if free is not None and free < replica.sleep_host_bytes:
        return ""
    fleet.add(host_share(replica))
    return (f"put to sleep, not stopped: asked for {now - model.last_requested_at:.0f} s ago (within the "
            f"{settings.sleep_window_s:.0f} s sleep window), and a wake takes seconds where a reload takes far longer")


def asleep_too_long(replica: ReplicaInfo, model: DesiredModel | None, snapshot: Snapshot, settings) -> str:
    """The reason a sleeping replica is stopped now ("" to let it sleep on)."""
    if model is None:
        return "not-desired"
    node = next((n for n in snapshot.nodes if n.name == replica.node), None)
    if node is not None and node.state == "draining":
        return "drained"
    last = model.last_requested_at
    if last is not None and snapshot.now - last >= settings.sleep_window_s:
        return "idle"
    return ""


def wakes_there(replica: ReplicaInfo, model: DesiredModel, fleet: Fleet, quotas: Quotas) -> str:
    """Why the sleeping replica cannot be woken where it sleeps ("" when it can): its node takes no
    work, its GPUs no longer have the room, another replica of its model is on one of them, or its
    owner's quota is spent."""
    node = fleet.nodes.get(replica.node)
    if node is None or node.state != "ready":
        return "its node takes no work"
    for acc in replica.accelerators:
        if fleet.free_acc.get(acc, 0) < replica.memory_bytes or acc in fleet.mig_used:
            return f"{acc} no longer has the room"
    if set(fleet.card_of(a) for a in replica.accelerators) & set(fleet.cards_used(model.id)):
        return "another replica of its model runs there"
    return quotas.refusal(model.owner, replica_need(replica)) if quotas.governed else ""


def demand_reason(model: DesiredModel) -> str:
    return "the requests waiting for it" if model.waiting else "its minimum"


# Why a replica leaves, what its eviction is called, and what is said once it stops.
MOVED = {"drain": "drained", "restart": "restarted"}
MOVE_NAMES = {"drain": "its node is draining", "restart": "a rolling restart"}
MOVE_DONE = {"drain": "its node is draining and a replacement is ready elsewhere",
             "restart": "restarted: a new replica is ready in its place"}
NOT_PLACED_HERE = "cannot be moved: not a catalog model (deployed by hand), so Berth does not place it; stop it by hand"


def leaving_replicas(snapshot: Snapshot, models: dict[str, DesiredModel],
                     by_model: dict[str, list[ReplicaInfo]]) -> dict[str, str]:
    """Replica id → why it leaves: ``drain`` (its node is draining) or ``restart`` (the oldest replica
    of a model whose rolling restart is under way created before it was asked: one at a time)."""
    draining = {node.name for node in snapshot.nodes if node.state == "draining"}
    leaving = {}
    for model_id, mine in by_model.items():
        leaving.update((r.id, "drain") for r in mine if r.node in draining)
        model = models.get(model_id)
        if model is not None and model.restart_before is not None:
            old = [r for r in mine if r.created_at < model.restart_before and r.id not in leaving]
            if old:
                leaving[min(old, key=lambda r: (r.created_at, r.id)).id] = "restart"
    return leaving


SPREAD = "spread"  # the reason code of replicas that would fit only beside another replica of their model


def first_reason(demand: Demand, fleet: Fleet, quotas: Quotas, placer: Placer,
                 missing: int | None = None) -> tuple[str, str]:
    if not demand.profiles:
        return "the model has no profile", "no-profile"
    for profile in demand.profiles:
        refusal = quotas.refusal(demand.model.owner, need_of(profile, demand.extra_bytes)) if quotas.governed else ""
        if refusal:
            return refusal, "quota"
    reasons: list = []
    placer.forget_spread(demand.model.id)  # what the packing saw of it is not what this scan sees
    placer.best_spot(fleet, demand.model, demand.profiles[0], demand.extra_bytes, reasons)
    if not reasons:
        return "no node in the fleet", "no-nodes"
    spread = [(p, n, t) for p, n, t in reasons if (demand.model.id, n) in placer.spread_refusals]
    if spread:
        # It would fit on a GPU that already runs one of its replicas: none is placed there.
        profile, node, text = spread[0]
        more = "another replica" if missing is None else f"{missing} more replica(s)"
        return (f"{more} would fit only on a GPU that already runs one of its replicas; "
                f"two replicas on one GPU share its compute and its failures, so none is placed there "
                f"(profile {profile}: {text})", SPREAD)
    profile, node, text = reasons[0]
    named = constraint_refusal(fleet, demand.profiles[0], placer)
    if named is not None:
        sentence, code = named
        return f"{sentence} ({len(reasons)} rejections; first: {text})", code
    return f"fits nowhere ({len(reasons)} rejections); first: profile {profile}: {text}", "no-fit"


# --- explain and headroom (dry runs; nothing here changes anything) ----------------------------------

def explain(snapshot: Snapshot, model_id: str) -> list[dict]:
    """Per profile and node, why the model's next replica would be rejected there (or that it fits)."""
    model = next((m for m in snapshot.models if m.id == model_id), None)
    if model is None:
        return []
    plan = schedule(snapshot)  # the state the next replica would meet: this pass applied
    fleet = apply_to_fleet(snapshot, plan)
    quotas = Quotas(snapshot.contracts, {m.id: m.owner for m in snapshot.models}, fleet.replicas.values())
    placer = Placer()
    rows = []
    for profile in ordered_profiles(model):
        placer.forget_spread(model.id)
        refusal = quotas.refusal(model.owner, need_of(profile, draft_bytes(model))) if quotas.governed else ""
        for node in fleet.nodes.values():
            if refusal:
                rows.append({"profile": profile.name, "node": node.name, "fits": False, "reason": refusal,
                             "code": "quota"})
                continue
            reason = placer._static_for(node, profile)
            code = "rejected"
            if not reason:
                reason, _ = placer.dynamic_reason(fleet, node, model, profile, draft_bytes(model))
                if reason and (model.id, node.name) in placer.spread_refusals:
                    code = SPREAD
            rows.append({"profile": profile.name, "node": node.name, "fits": not reason,
                         "reason": reason or "fits", "code": "" if not reason else code})
    return rows


def apply_to_fleet(snapshot: Snapshot, plan: Plan) -> Fleet:
    replicas = apply(snapshot, plan).replicas
    return Fleet(snapshot.nodes, replicas)


def apply(snapshot: Snapshot, plan: Plan) -> Snapshot:
    """The snapshot after a plan is applied as Serving would: evictions gone, launches starting."""
    gone = {e.replica for e in plan.evictions if not e.sleep}
    slept = {e.replica for e in plan.evictions if e.sleep}
    woken = {w.replica for w in plan.wakes}
    kept = []
    for r in snapshot.replicas:
        if r.id in gone:
            continue
        if r.id in slept:
            r = dataclasses.replace(r, state=ASLEEP, ready_since=None, active_requests=0)
        elif r.id in woken:
            r = dataclasses.replace(r, state="starting", ready_since=None)
        kept.append(r)
    counts: dict[str, int] = {}
    for r in kept:
        counts[r.model] = counts.get(r.model, 0) + 1
    models = {m.id: m for m in snapshot.models}
    for launch in plan.launches:
        model = models.get(launch.model)
        kept.append(ReplicaInfo(id=f"r:{launch.model}:{launch.node}:{','.join(launch.accelerators)}:{len(kept)}",
                                model=launch.model, profile=launch.profile, node=launch.node,
                                accelerators=launch.accelerators, memory_bytes=launch.memory_bytes,
                                cpu_cores=launch.cpu_cores, state="starting", pinned=bool(model and model.pinned),
                                created_at=snapshot.now, fingerprint=model.fingerprint if model else ""))
    return dataclasses.replace(snapshot, replicas=tuple(kept), holds=plan.holds)


def headroom(snapshot: Snapshot, model_id: str, limit: int = 16) -> dict:
    """How many more replicas of the model fit, dry-running on a copy (no preemption); stops at a
    quota limit and says so."""
    limit = max(1, min(limit, 64))
    model = next((m for m in snapshot.models if m.id == model_id), None)
    if model is None:
        return {"model": model_id, "more": 0, "blocked": "not in the catalog"}
    plan = schedule(snapshot)
    fleet = apply_to_fleet(snapshot, plan)
    quotas = Quotas(snapshot.contracts, {m.id: m.owner for m in snapshot.models}, fleet.replicas.values())
    placer = Placer()
    demand = Demand(model=model, slot=10_000, tier=2, reason="headroom", profiles=tuple(ordered_profiles(model)),
                    extra_bytes=draft_bytes(model))
    more, blocked, where = 0, "", []
    while more < limit:
        profile, spot, refusal = try_place(demand, fleet, quotas, placer)
        if spot is None:
            blocked = refusal or first_reason(demand, fleet, quotas, placer)[0]
            break
        commit(demand, profile, spot, fleet, quotas, snapshot.now)
        demand = Demand(model=model, slot=demand.slot + 1, tier=2, reason="headroom", profiles=demand.profiles,
                        extra_bytes=demand.extra_bytes)
        where.append(spot.node)
        more += 1
    if more >= limit and not blocked:
        blocked = f"stopped counting at {limit}"
    return {"model": model_id, "more": more, "blocked": blocked, "nodes": where,
            "free_bytes_before": Fleet(snapshot.nodes, apply(snapshot, plan).replicas).total_free_bytes(),
            "free_bytes_after": fleet.total_free_bytes()}


def _named_to(model, reader) -> str:
    """How a decision about ``reader`` names ``model``: by name when both belong to one scope (or are
    shared), else without it — the victim's owner reads the decision, and another tenant's model
    names are not theirs to see."""
    return model.id if model.owner == reader.owner else "a model of another scope"
