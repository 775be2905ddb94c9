"""Moving replicas in the pure policy: a draining node's replicas are replaced elsewhere and stop only
once their replacements are ready; a rolling restart replaces a model's replicas one at a time; what
cannot be moved says why, and nothing is preempted to move a replica that still serves."""

import dataclasses

from hypothesis import given, strategies as st

from scheduler.policy.inputs import (
    GIB, AcceleratorInfo, DesiredModel, NodeInfo, Profile, ReplicaInfo, Scaling, Snapshot,
)
from scheduler.policy.plan import MOVED, NOT_PLACED_HERE, apply, leaving_replicas, schedule
from scheduler.policy.residency import desired_count
from tests.scheduler.test_policy_properties import PROPS, snapshots

G = GIB
NOW = 100_000.0


def gpu_node(name, gpus=2, mem=80, state="ready"):
    accs = tuple(AcceleratorInfo(f"{name}-g{i}", i, "h100-80g", mem * G) for i in range(gpus))
    return NodeInfo(name, state=state, engines=frozenset({"vllm"}), cpu_count=64, memory_bytes=256 * G,
                    accelerators=accs)


def model(mid, gib=10, count=1, **kw):
    return DesiredModel(mid, (Profile("default", "vllm", 1, gib * G),), Scaling(min=count), **kw)


def running(rid, mid, node, gpu=0, gib=10, created=NOW - 3600, ready=True, **kw):
    return ReplicaInfo(rid, mid, "default", node, (f"{node}-g{gpu}",), gib * G, created_at=created,
                       ready_since=created + 60 if ready else None, **kw)


def ready(snapshot: Snapshot, plan) -> Snapshot:
    """The plan applied and its launches come up ready."""
    after = apply(snapshot, plan)
    return dataclasses.replace(after, now=after.now + 30, replicas=tuple(
        dataclasses.replace(r, state="ready", ready_since=after.now) if r.ready_since is None else r
        for r in after.replicas))


def test_a_draining_nodes_replica_is_replaced_elsewhere_and_stops_only_once_the_new_one_is_ready():
    nodes = (gpu_node("a", state="draining"), gpu_node("b"))
    snap = Snapshot(NOW, nodes, (model("m"),), (running("old", "m", "a"),))
    first = schedule(snap)
    assert [(l.model, l.node, l.reason) for l in first.launches] == [("m", "b", "replacement")]
    assert not first.evictions  # the old one serves until its replacement is ready
    [move] = first.moves
    assert (move.replica, move.node, move.why, move.state) == ("old", "a", "drain", "waiting")
    assert any(d.verdict == "moving" and d.victims == ("old",) for d in first.decisions)

    starting = apply(snap, first)  # the replacement is starting, not ready
    second = schedule(starting)
    assert second.empty and [m.state for m in second.moves] == ["waiting"]

    third = schedule(ready(snap, first))
    assert [(e.replica, e.reason) for e in third.evictions] == [("old", "drained")] and not third.launches
    assert [m.state for m in third.moves] == ["stopping"]
    assert schedule(apply(ready(snap, first), third)).empty  # converged: nothing left on a, nothing new


def test_replicas_already_elsewhere_let_a_draining_replica_stop_at_once():
    nodes = (gpu_node("a", state="draining"), gpu_node("b"))
    snap = Snapshot(NOW, nodes, (model("m", count=1),), (running("old", "m", "a"), running("other", "m", "b")))
    plan = schedule(snap)
    assert [(e.replica, e.reason) for e in plan.evictions] == [("old", "drained")] and not plan.launches


def test_what_cannot_be_moved_stays_and_says_why_and_moving_preempts_nothing():
    # b is full of another model's replica: no room for m's replacement, and none is made.
    nodes = (gpu_node("a", gpus=1, state="draining"), gpu_node("b", gpus=1))
    snap = Snapshot(NOW, nodes, (model("m", gib=60), model("x", gib=60, priority=0)),
                    (running("old", "m", "a", gib=60), running("x1", "x", "b", gib=60)))
    plan = schedule(snap)
    assert plan.empty  # no launch, no eviction: m keeps serving on a, x keeps b
    [move] = plan.moves
    assert move.state == "blocked" and move.detail.startswith("cannot be moved: ")
    assert "fits nowhere" in move.detail or "is draining" in move.detail
    assert [u.model for u in plan.unschedulable] == ["m"]


def test_a_hand_deployed_replica_on_a_draining_node_is_named_as_not_movable():
    nodes = (gpu_node("a", state="draining"), gpu_node("b"))
    hand = ReplicaInfo("reservation:x", "reservation:x", "", "a", ("a-g0",), 5 * G, pinned=True)
    plan = schedule(Snapshot(NOW, nodes, (), (hand,)))
    assert plan.empty and [(m.replica, m.state, m.detail) for m in plan.moves] == [
        ("reservation:x", "blocked", NOT_PLACED_HERE)]


def test_an_idle_on_demand_replica_on_a_draining_node_just_stops():
    nodes = (gpu_node("a", state="draining"), gpu_node("b"))
    idle = model("m", count=0, last_requested_at=NOW - 7200)
    plan = schedule(Snapshot(NOW, nodes, (idle,), (running("old", "m", "a", last_used_at=NOW - 7200),)))
    assert not plan.launches and [e.replica for e in plan.evictions] == ["old"]


def test_a_rolling_restart_replaces_one_replica_at_a_time_oldest_first():
    nodes = (gpu_node("a", gpus=2), gpu_node("b", gpus=2))
    asked = NOW - 10
    snap = Snapshot(NOW, nodes, (model("m", count=2, restart_before=asked),),
                    (running("r1", "m", "a", created=NOW - 7200), running("r2", "m", "b", created=NOW - 3600)))
    first = schedule(snap)
    assert [(l.reason, l.node) for l in first.launches] == [("replacement", "a")]  # beside r1's node, another GPU
    assert [(m.replica, m.why, m.state) for m in first.moves] == [("r1", "restart", "waiting")]

    step = ready(snap, first)
    second = schedule(step)
    assert [(e.replica, e.reason) for e in second.evictions] == [("r1", "restarted")]
    assert not second.launches  # r2 waits its turn: one at a time

    step = apply(step, second)
    third = schedule(step)
    assert len(third.launches) == 1 and [m.replica for m in third.moves] == ["r2"]
    step = ready(step, third)
    fourth = schedule(step)
    assert [e.replica for e in fourth.evictions] == ["r2"]
    done = apply(step, fourth)
    assert schedule(done).empty and not schedule(done).moves  # every replica now is newer than the ask
    assert all(r.created_at >= asked for r in done.replicas)


def test_a_rolling_restart_with_no_room_for_a_second_copy_is_blocked_not_forced():
    snap = Snapshot(NOW, (gpu_node("a", gpus=1),), (model("m", count=1, restart_before=NOW - 1),),
                    (running("r1", "m", "a"),))
    plan = schedule(snap)
    assert plan.empty and plan.moves[0].state == "blocked"
    assert "already runs one of its replicas" in plan.moves[0].detail  # the spread rule: not beside itself


@st.composite
def moving(draw):
    """A random resident state (the policy properties'), then a node drains and some models restart."""
    snap = draw(snapshots())
    drained = draw(st.integers(0, len(snap.nodes) - 1))
    nodes = tuple(dataclasses.replace(n, state="draining") if i == drained else n for i, n in enumerate(snap.nodes))
    restarts = draw(st.lists(st.booleans(), min_size=len(snap.models), max_size=len(snap.models)))
    models = tuple(dataclasses.replace(m, restart_before=snap.now - 1) if again else m
                   for m, again in zip(snap.models, restarts))
    return dataclasses.replace(snap, nodes=nodes, models=models)


@PROPS
@given(moving())
def test_a_leaving_replica_stops_only_when_enough_ready_replicas_stay_and_nothing_lands_on_a_draining_node(snap):
    plan = schedule(snap)
    models = {m.id: m for m in snap.models}
    by_model = {}
    for replica in snap.replicas:
        by_model.setdefault(replica.model, []).append(replica)
    leaving = leaving_replicas(snap, models, by_model)
    gone = {e.replica for e in plan.evictions}
    draining = {n.name for n in snap.nodes if n.state == "draining"}
    assert not any(launch.node in draining for launch in plan.launches)
    for eviction in plan.evictions:
        if eviction.reason not in MOVED.values():
            continue
        assert eviction.replica in leaving
        mine = by_model[eviction.model]
        stopped = next(r for r in mine if r.id == eviction.replica)
        if stopped.ready_since is None:
            continue  # it served nobody yet: stopping it takes nothing away
        wanted = desired_count(models[eviction.model], mine, snap.now)[0]
        still_ready = [r for r in mine if r.id not in gone and r.ready_since is not None]
        assert len(still_ready) >= wanted, (eviction, still_ready, wanted)  # a surplus of leaving ones may go
    # Every leaving replica of a catalog model is accounted for: stopping, waiting or blocked.
    assert {m.replica for m in plan.moves} == set(leaving) - (gone - {m.replica for m in plan.moves})
    for restarting in {m.id for m in snap.models if m.restart_before is not None}:
        mine = {x.id for x in by_model.get(restarting, ())}
        assert sum(1 for r, why in leaving.items() if why == "restart" and r in mine) <= 1  # one at a time
    # And applying it converges, as every plan does.
    after = apply(snap, plan)
    again = schedule(after)
    assert not (set(l.node for l in again.launches) & draining)
