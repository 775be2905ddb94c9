"""The placement policy without a database: placement, residency, preemption, quotas, recovery, scaling."""

import dataclasses

from scheduler.policy import recovery, scaling
from scheduler.policy.inputs import (
    GIB, AcceleratorInfo, DesiredModel, Draft, FailureState, Hold, NodeInfo, Profile, ReplicaInfo, Resources,
    Scaling, ScopeContract, Snapshot,
)
from scheduler.policy.placement import ordered_profiles
from scheduler.policy.plan import apply, explain, headroom, schedule

G = GIB
NOW = 100_000.0


def gpu_node(name, gpus=4, mem=80, cls="h100", **kw):
    accs = tuple(AcceleratorInfo(f"{name}-g{i}", i, cls, mem * G) for i in range(gpus))
    defaults = dict(engines=frozenset({"vllm", "llamacpp"}), cpu_count=64, memory_bytes=512 * G, accelerators=accs)
    defaults.update(kw)
    return NodeInfo(name, **defaults)


def cpu_node(name, cores=16, mem=64, **kw):
    return NodeInfo(name, engines=frozenset({"llamacpp"}), cpu_count=cores, memory_bytes=mem * G, **kw)


def model(mid, gib=10, gpus=1, priority=1, **kw):
    profiles = kw.pop("profiles", None) or (Profile("default", "vllm", gpus, gib * G),)
    return DesiredModel(mid, profiles, priority=priority, **kw)


def ready(rid, mid, node, accs, gib, **kw):
    defaults = dict(ready_since=NOW - 3600, last_used_at=NOW - 10, created_at=NOW - 3600, load_seconds=30)
    defaults.update(kw)
    return ReplicaInfo(rid, mid, "default", node, tuple(accs), gib * G, **defaults)


def fixed_point(snapshot):
    plan = schedule(snapshot)
    again = schedule(apply(snapshot, plan))
    assert again.empty, (plan, again)
    return plan


# --- placement -------------------------------------------------------------------------------------

def test_converged_state_yields_an_empty_plan():
    snap = Snapshot(NOW, (gpu_node("a"),), (model("m"),), (ready("r1", "m", "a", ["a-g0"], 10),))
    assert schedule(snap).empty


def test_bin_packing_prefers_the_fuller_node():
    nodes = (gpu_node("a"), gpu_node("b"))
    snap = Snapshot(NOW, nodes, (model("x"), model("y", gib=60)), (ready("r1", "x", "b", ["b-g0"], 10),))
    plan = fixed_point(snap)
    assert [(l.node, l.accelerators) for l in plan.launches] == [("b", ("b-g0",))]


def test_nodes_holding_the_weights_come_first():
    nodes = (gpu_node("a"), gpu_node("b", weights=frozenset({"w"})))
    plan = fixed_point(Snapshot(NOW, nodes, (model("m", weights_key="w"),)))
    assert plan.launches[0].node == "b"


def test_replicas_spread_across_nodes_unless_that_is_the_only_obstacle():
    nodes = (gpu_node("a"), gpu_node("b"))
    plan = fixed_point(Snapshot(NOW, nodes, (model("m", scaling=Scaling(min=2)),)))
    assert sorted(l.node for l in plan.launches) == ["a", "b"]
    plan = fixed_point(Snapshot(NOW, (gpu_node("a"),), (model("m", scaling=Scaling(min=3)),)))
    assert [l.node for l in plan.launches] == ["a", "a", "a"]


def test_tensor_parallel_uses_accelerators_of_one_node():
    nodes = (gpu_node("a", gpus=2), gpu_node("b", gpus=2))
    plan = fixed_point(Snapshot(NOW, nodes, (model("big", gpus=4, gib=70),)))
    assert not plan.launches and plan.unschedulable[0].code == "no-fit"
    plan = fixed_point(Snapshot(NOW, (gpu_node("c", gpus=4),), (model("big", gpus=4, gib=70),)))
    assert len(plan.launches[0].accelerators) == 4


def test_mig_instances_take_one_single_accelerator_replica():
    accs = (AcceleratorInfo("card", 0, "a100", 80 * G, placeable=False, unplaceable_reason="MIG mode: use its instances"),
            AcceleratorInfo("mig0", 0, "a100-3g.40gb", 40 * G, mig=True),
            AcceleratorInfo("mig1", 0, "a100-3g.40gb", 40 * G, mig=True))
    node = NodeInfo("m", engines=frozenset({"vllm"}), accelerators=accs)
    plan = fixed_point(Snapshot(NOW, (node,), (model("s1", gib=5), model("s2", gib=5), model("s3", gib=5))))
    assert sorted(l.accelerators for l in plan.launches) == [("mig0",), ("mig1",)]
    assert [u.model for u in plan.unschedulable] == ["s3"]
    rows = explain(Snapshot(NOW, (node,), (model("tp", gpus=2, gib=5),)), "tp")
    assert "needs 2" in rows[0]["reason"]


def test_filters_name_what_is_wrong():
    nodes = (gpu_node("cordoned", state="cordoned"), gpu_node("noeng", engines=frozenset()),
             gpu_node("install", engines=frozenset(), engines_installing=frozenset({"vllm"})),
             gpu_node("label"), gpu_node("small", mem=8), gpu_node("disk", disk_free_bytes=1 * G))
    prof = Profile("p", "vllm", 1, 20 * G, min_disk_bytes=100 * G, node_selector={})
    rows = {r["node"]: r["reason"] for r in explain(Snapshot(NOW, nodes, (model("m", profiles=(prof,)),)), "m")}
    assert "cordoned" in rows["cordoned"]
    assert "no vllm engine" in rows["noeng"]
    assert "installing" in rows["install"]
    assert "with 20.0 GiB free" in rows["small"]
    assert "disk" in rows["disk"]
    assert rows["label"] == "fits"
    sel = Profile("p", "vllm", 1, 20 * G, node_selector={"zone": "eu"})
    rows = explain(Snapshot(NOW, (gpu_node("label"),), (model("m", profiles=(sel,)),)), "m")
    assert "zone=eu" in rows[0]["reason"]


def test_cpu_profiles_reserve_cores_and_prefer_fewest_replicas():
    prof = Profile("cpu", "llamacpp", 0, 4 * G, cpu_cores=6)
    nodes = (cpu_node("c1"), cpu_node("c2"))
    snap = Snapshot(NOW, nodes, (model("m", profiles=(prof,), scaling=Scaling(min=3)),))
    plan = fixed_point(snap)
    assert sorted(l.node for l in plan.launches) == ["c1", "c1", "c2"] or sorted(l.node for l in plan.launches) == ["c1", "c2", "c2"]
    plan = fixed_point(Snapshot(NOW, (cpu_node("c1", cores=8),), (model("m", profiles=(prof,), scaling=Scaling(min=2)),)))
    assert "has 8 CPUs with 2 free, needs 6" in plan.unschedulable[0].reason


def test_profiles_by_priority_then_measured_tokens_per_accelerator():
    a = Profile("a", gpus=2, tokens_per_s=100)
    b = Profile("b", gpus=1, tokens_per_s=80)
    c = Profile("c", gpus=1)
    d = Profile("d", gpus=1, priority=5)
    assert [p.name for p in ordered_profiles(model("m", profiles=(c, a, b, d)))] == ["d", "b", "a", "c"]


# --- residency ---------------------------------------------------------------------------------------

def test_draft_is_admitted_only_when_both_fit():
    m = model("m", gib=70, draft=Draft("d", 15 * G))
    plan = fixed_point(Snapshot(NOW, (gpu_node("a", gpus=1),), (m,)))
    assert plan.unschedulable and not plan.launches
    plan = fixed_point(Snapshot(NOW, (gpu_node("a", gpus=1),), (model("m", gib=60, draft=Draft("d", 15 * G)),)))
    assert plan.launches[0].memory_bytes == 75 * G and plan.launches[0].draft == "d"


def test_on_demand_unloads_after_idle_timeout_but_unknown_idle_is_not_idle():
    od = model("od", scaling=Scaling(min=0, max=1, idle_timeout_s=600), last_requested_at=NOW - 700)
    rep = ready("r", "od", "a", ["a-g0"], 10, last_used_at=NOW - 700)
    plan = schedule(Snapshot(NOW, (gpu_node("a"),), (od,), (rep,)))
    assert [(e.replica, e.reason) for e in plan.evictions] == [("r", "idle")]
    unknown = dataclasses.replace(od, last_requested_at=None)
    assert schedule(Snapshot(NOW, (gpu_node("a"),), (unknown,), (dataclasses.replace(rep, last_used_at=None),))).empty
    waiting = dataclasses.replace(od, last_requested_at=None, waiting=2)
    assert len(schedule(Snapshot(NOW, (gpu_node("a"),), (waiting,))).launches) == 1


def test_pinned_and_active_replicas_are_never_evicted():
    reps = (ready("p", "gone", "a", ["a-g0"], 10, pinned=True), ready("b", "gone", "a", ["a-g1"], 10, active_requests=3),
            ready("c", "gone", "a", ["a-g2"], 10))
    plan = schedule(Snapshot(NOW, (gpu_node("a"),), (), reps))
    assert [e.replica for e in plan.evictions] == ["c"]


def test_surplus_eviction_prefers_most_bytes_for_least_reload_cost():
    reps = (ready("small-idle", "m", "a", ["a-g0"], 10, last_used_at=NOW - 1000, load_seconds=10, created_at=1),
            ready("big-idle", "m", "a", ["a-g1"], 10, last_used_at=NOW - 1000, load_seconds=5, created_at=2),
            ready("busy", "m", "a", ["a-g2"], 10, last_used_at=NOW - 1, created_at=3))
    plan = schedule(Snapshot(NOW, (gpu_node("a"),), (model("m", scaling=Scaling(min=1)),), reps))
    assert sorted(e.replica for e in plan.evictions) == ["big-idle", "small-idle"]


def test_cost_aware_packing_beats_priority_order():
    # One 80 GiB GPU: a priority-3 70 GiB model versus four priority-1 20 GiB ones.
    models = (model("big", gib=70, priority=3),) + tuple(model(f"s{i}", gib=20, priority=1) for i in range(4))
    plan = fixed_point(Snapshot(NOW, (gpu_node("a", gpus=1),), models))
    assert sorted(l.model for l in plan.launches) == ["s0", "s1", "s2", "s3"]


# --- preemption ----------------------------------------------------------------------------------------

def _full(node="a", gpus=2):
    return gpu_node(node, gpus=gpus)


def test_critical_preempts_lower_class_minimum_and_holds_the_victim_back():
    low = model("low", gib=70, capacity_class="opportunistic")
    crit = model("crit", gib=70, capacity_class="critical")
    reps = (ready("r-low", "low", "a", ["a-g0"], 70),)
    snap = Snapshot(NOW, (gpu_node("a", gpus=1),), (low, crit), reps)
    plan = fixed_point(snap)
    assert [(e.replica, e.reason, e.grace_s, e.beneficiary) for e in plan.evictions] == [("r-low", "preempted", 30, "crit")]
    assert plan.launches[0].beneficiary_of == ("r-low",)
    assert plan.holds[0].model == "low"
    after = schedule(apply(snap, plan))
    assert after.unschedulable[0].code == "held"


def test_a_preempted_models_decisions_name_the_winner_only_within_one_scope():
    """The victim's owner reads its decisions ("gave room to …", "held back … after giving room to
    …"): another scope's model is not named there."""
    def preempted(victim_owner, winner_owner):
        low = model("low", gib=70, capacity_class="opportunistic", owner=victim_owner)
        crit = model("crit-of-globex", gib=70, capacity_class="critical", owner=winner_owner)
        snap = Snapshot(NOW, (gpu_node("a", gpus=1),), (low, crit), (ready("r-low", "low", "a", ["a-g0"], 70),))
        plan = fixed_point(snap)
        after = schedule(apply(snap, plan))
        return [d.detail for d in plan.decisions + after.decisions if d.model == "low"]

    for detail in preempted("acme/ml", "globex/ml"):
        assert "crit-of-globex" not in detail and "another scope" in detail
    same = preempted("acme/ml", "acme/ml")
    assert any("gave room to crit-of-globex" in d for d in same)
    assert any("after giving room to crit-of-globex" in d for d in same)


def test_a_critical_minimum_is_never_preempted():
    crit = model("crit", gib=70, capacity_class="critical")
    other = model("other", gib=70, capacity_class="critical", scaling=Scaling(min=1))
    snap = Snapshot(NOW, (gpu_node("a", gpus=1),), (crit, other), (ready("r", "crit", "a", ["a-g0"], 70),))
    plan = fixed_point(snap)
    assert not plan.evictions and plan.unschedulable[0].model == "other"


def od(mid, gib=10, priority=1, **kw):
    """An on-demand (min 0) model."""
    return model(mid, gib=gib, priority=priority, scaling=Scaling(min=0, max=1, idle_timeout_s=3600), **kw)


def test_victims_are_taken_from_one_place_when_the_global_order_spreads_them():
    # Longest idle first alternates between the two GPUs: its first three free neither enough for
    # 70 GiB. One GPU at a time, the second GPU's two replicas are the smallest set that does.
    reps = (ready("a1", "s1", "a", ["a-g0"], 20, last_used_at=NOW - 1000), ready("b1", "m1", "a", ["a-g1"], 35, last_used_at=NOW - 900),
            ready("a2", "s2", "a", ["a-g0"], 20, last_used_at=NOW - 800), ready("b2", "m2", "a", ["a-g1"], 35, last_used_at=NOW - 700),
            ready("a3", "s3", "a", ["a-g0"], 20, last_used_at=NOW - 300))
    models = tuple(od(m, gib, priority=1, last_requested_at=NOW - 100)
                   for m, gib in (("s1", 20), ("s2", 20), ("s3", 20), ("m1", 35), ("m2", 35)))
    big = od("big", 70, priority=5, waiting=1, waiting_since=NOW - 5)
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=2),), models + (big,), reps))
    assert sorted(e.replica for e in plan.evictions) == ["b1", "b2"]
    assert [(l.model, l.accelerators, l.beneficiary_of) for l in plan.launches] == [("big", ("a-g1",), ("b1", "b2"))]


def test_a_load_takes_room_only_from_idle_replicas_worth_no_more_until_it_has_waited():
    busy_model = od("popular", 60, priority=50, last_requested_at=NOW - 100)
    rep = ready("p", "popular", "a", ["a-g0"], 60, last_used_at=NOW - 300)  # idle past the eviction grace
    rare = od("rare", 60, priority=1, waiting=1, waiting_since=NOW - 5)
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (busy_model, rare), (rep,)))
    assert not plan.evictions and [u.model for u in plan.unschedulable] == ["rare"]  # a rare model waits
    starved = dataclasses.replace(rare, waiting_since=NOW - 31)
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (busy_model, starved), (rep,)))
    assert [e.replica for e in plan.evictions] == ["p"] and plan.launches[0].model == "rare"  # but never starves
    worth_more = dataclasses.replace(rare, priority=80)
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (busy_model, worth_more), (rep,)))
    assert [e.replica for e in plan.evictions] == ["p"]  # worth more: at once


def test_a_load_only_batch_requests_wait_for_takes_free_room_and_preempts_nothing():
    idle = od("idle", 60, priority=1, last_requested_at=NOW - 100)
    rep = ready("i", "idle", "a", ["a-g0"], 60, last_used_at=NOW - 300)  # idle past the eviction grace
    wanted = od("wanted", 60, priority=80, waiting=3, waiting_since=NOW - 3600)  # worth more, starved
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (idle, wanted), (rep,)))
    assert [e.replica for e in plan.evictions] == ["i"]  # an interactive request would push it out
    batch = dataclasses.replace(wanted, waiting_batch_only=True)
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (idle, batch), (rep,)))
    assert not plan.evictions and not plan.launches
    assert "only batch requests wait for it" in plan.unschedulable[0].reason
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=2),), (idle, batch), (rep,)))  # free room: loaded there
    assert not plan.evictions and [(l.model, l.accelerators) for l in plan.launches] == [("wanted", ("a-g1",))]


def test_an_on_demand_model_without_a_replica_loads_only_for_a_waiting_request():
    recently = od("m", last_requested_at=NOW - 10)  # used a moment ago, then preempted: no replica now
    assert schedule(Snapshot(NOW, (gpu_node("a"),), (recently,))).empty
    waiting = dataclasses.replace(recently, waiting=1, waiting_since=NOW)
    assert len(schedule(Snapshot(NOW, (gpu_node("a"),), (waiting,))).launches) == 1


def test_young_replicas_and_other_owners_guarantees_are_protected():
    low = model("low", gib=70, capacity_class="opportunistic", owner="acme/a")
    std = model("std", gib=70, owner="acme/b")
    young = ready("r", "low", "a", ["a-g0"], 70, ready_since=NOW - 60)
    assert not schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (low, std), (young,))).evictions
    old = ready("r", "low", "a", ["a-g0"], 70)
    contracts = (ScopeContract("acme/a", "team:acme/a", guarantee=Resources(gpus=1)),)
    assert not schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (low, std), (old,), contracts)).evictions
    assert schedule(Snapshot(NOW, (gpu_node("a", gpus=1),), (low, std), (old,))).evictions


def test_borrowed_replicas_are_reclaimed_for_a_guaranteed_scope():
    lender = model("lend", gib=70, owner="acme/a", capacity_class="critical", scaling=Scaling(min=1, max=2), extra=1)
    needy = model("needy", gib=70, owner="acme/b")
    reps = (ready("r1", "lend", "a", ["a-g0"], 70, created_at=1), ready("r2", "lend", "a", ["a-g1"], 70, created_at=2))
    contracts = (ScopeContract("acme/a", guarantee=Resources(gpus=1)), ScopeContract("acme/b", guarantee=Resources(gpus=1)))
    plan = fixed_point(Snapshot(NOW, (gpu_node("a", gpus=2),), (lender, needy), reps, contracts))
    assert [(e.replica, e.tier) for e in plan.evictions] == [("r2", 1)]


# --- quotas --------------------------------------------------------------------------------------------

def test_a_limit_refuses_naming_the_scope_and_figure():
    contracts = (ScopeContract("acme", "org:acme", limit=Resources(gpus=2)),)
    m = model("m", gpus=2, gib=10, owner="acme/ml", scaling=Scaling(min=2))
    plan = fixed_point(Snapshot(NOW, (gpu_node("a"), gpu_node("b")), (m,), (), contracts))
    assert len(plan.launches) == 1
    assert plan.unschedulable[0].code == "quota"
    assert "org:acme is at its GPUs limit (2 of 2 held; 2 more asked)" == plan.unschedulable[0].reason


def test_headroom_counts_on_a_copy_and_stops_at_a_limit():
    snap = Snapshot(NOW, (gpu_node("a"),), (model("m", gib=30),))
    room = headroom(snap, "m")
    # 8 slots of 30 GiB on 4×80 GiB, but one replica of a model per GPU (spread): 4, one of them the
    # pending launch; what stops the count says so.
    assert room["more"] == 3 and room["blocked"].startswith("another replica would fit only on a GPU")
    contracts = (ScopeContract("acme", "org:acme", limit=Resources(gpus=3)),)
    snap = Snapshot(NOW, (gpu_node("a"),), (model("m", gib=30, owner="acme"),), (), contracts)
    room = headroom(snap, "m")
    assert room["more"] == 2 and "limit" in room["blocked"]


# --- recovery and parking --------------------------------------------------------------------------

def test_recovery_ladder_escalates_and_never_retries_oom_unchanged():
    assert [recovery.ladder("oom", n) for n in (1, 2, 3)] == ["degrade", "fallback", "quarantine"]
    assert [recovery.ladder("hang", n) for n in (1, 2, 3, 4)] == ["retry", "degrade", "fallback", "quarantine"]
    assert [recovery.ladder("crash", n) for n in (1, 2, 3, 4, 5)] == ["retry", "retry", "retry", "retry", "quarantine"]
    for kind in ("oom", "hang", "crash"):
        sev = [recovery.SEVERITY[recovery.ladder(kind, n)] for n in range(1, 8)]
        assert sev == sorted(sev)
    assert recovery.backoff(1) == 10 and recovery.backoff(3) == 40 and recovery.backoff(20) == 300


def test_oom_degrades_then_falls_back_then_parks():
    m = model("m", fallbacks=("small",), fingerprint="f1")
    small = model("small", gib=4, scaling=Scaling(min=0))
    node = gpu_node("a")
    one = FailureState(kind="oom", consecutive=1, last_failure_at=NOW - 1000, level=1)
    plan = schedule(Snapshot(NOW, (node,), (m, small), failures={"m": one}))
    assert plan.launches[0].level == 1
    two = FailureState(kind="oom", consecutive=2, last_failure_at=NOW - 1000, level=2)
    plan = schedule(Snapshot(NOW, (node,), (m, small), failures={"m": two}))
    assert plan.launches[0].serves_for == "small" and plan.launches[0].memory_bytes == 4 * G
    state = None
    for i in range(5):
        state = recovery.record_failure(state, "crash", NOW - 10, "exit 1", fingerprint="f1")
    plan = schedule(Snapshot(NOW, (node,), (m, small), failures={"m": state}))
    assert plan.unschedulable[0].code == "parked" and not plan.launches
    changed = dataclasses.replace(m, fingerprint="f2")
    assert schedule(Snapshot(NOW, (node,), (changed, small), failures={"m": state})).launches


def test_crash_backs_off():
    state = recovery.record_failure(None, "crash", NOW - 5)
    plan = schedule(Snapshot(NOW, (gpu_node("a"),), (model("m"),), failures={"m": state}))
    assert plan.unschedulable[0].code == "backoff"
    assert schedule(Snapshot(NOW + 11, (gpu_node("a"),), (model("m"),), failures={"m": state})).launches


def test_unplaceable_log_repeats_only_on_change_or_every_ten_minutes():
    assert recovery.should_log(None, None, "x", 0)
    assert not recovery.should_log("x", 0, "x", 599)
    assert recovery.should_log("x", 0, "x", 600)
    assert recovery.should_log("x", 0, "y", 1)


# --- scaling -------------------------------------------------------------------------------------------

def test_load_scaling_adds_after_a_busy_minute_and_removes_after_quiet_ten():
    st = scaling.ScaleState()
    busy = scaling.Load(replicas=1, running=4, waiting=2)
    d = scaling.step(st, busy, base=1, maximum=3, now=0)
    assert d.change == 0 and d.state.busy_since == 0
    d = scaling.step(d.state, busy, base=1, maximum=3, now=60)
    assert d.change == 1 and "waiting per replica" in d.reason
    starting = scaling.Load(replicas=1, running=4, waiting=2, starting=1)
    assert scaling.step(d.state, starting, base=1, maximum=3, now=200).change == 0
    quiet = scaling.Load(replicas=2, running=1, waiting=0)
    q = scaling.step(d.state, quiet, base=1, maximum=3, now=300, max_concurrency=8)
    q = scaling.step(q.state, quiet, base=1, maximum=3, now=900, max_concurrency=8)
    assert q.change == -1 and q.state.extra == 0
    assert scaling.step(st, busy, base=1, maximum=1, now=0).state == scaling.ScaleState()
