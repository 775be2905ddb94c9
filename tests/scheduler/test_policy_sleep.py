"""Sleep as a residency tier in the pure policy: a replica that can sleep (vLLM) is put to sleep
rather than stopped when room is made or it goes idle, if its model was asked for recently and its
node's host memory can keep its weights; a request waiting for it wakes it where it sleeps when its
GPU has the room, else a new one is launched; asleep unasked past the window, it is stopped."""

import dataclasses

from hypothesis import given, strategies as st

from scheduler.policy.inputs import (
    GIB, AcceleratorInfo, DesiredModel, NodeInfo, Profile, ReplicaInfo, Scaling, Settings, Snapshot,
)
from scheduler.policy.plan import apply, schedule
from tests.scheduler.test_policy_properties import PROPS, snapshots

G = GIB
NOW = 100_000.0


def gpu_node(name="a", gpus=1, mem=80, ram=256):
    accs = tuple(AcceleratorInfo(f"{name}-g{i}", i, "h100-80g", mem * G) for i in range(gpus))
    return NodeInfo(name, engines=frozenset({"vllm"}), cpu_count=64, memory_bytes=ram * G, accelerators=accs)


def model(mid, gib=60, count=0, **kw):
    return DesiredModel(mid, (Profile("default", "vllm", 1, gib * G),), Scaling(min=count, idle_timeout_s=600), **kw)


def replica(rid, mid, gib=60, node="a", gpu=0, host=16, **kw):
    kw.setdefault("ready_since", NOW - 7200)
    return ReplicaInfo(rid, mid, "default", node, (f"{node}-g{gpu}",), gib * G, created_at=NOW - 7200,
                       sleep_host_bytes=host * G, load_seconds=90, **kw)


def test_an_idle_replica_asked_for_recently_sleeps_instead_of_stopping():
    idle = model("m", last_requested_at=NOW - 1200)  # idle past its 600 s timeout, asked 20 min ago
    plan = schedule(Snapshot(NOW, (gpu_node(),), (idle,), (replica("r", "m", last_used_at=NOW - 1200),)))
    [eviction] = plan.evictions
    assert (eviction.replica, eviction.reason, eviction.sleep) == ("r", "idle", True)
    [decision] = [d for d in plan.decisions if d.verdict == "evicted"]
    assert decision.codes == ("idle", "sleep") and "put to sleep, not stopped: asked for 1200 s ago" in decision.detail
    after = apply(Snapshot(NOW, (gpu_node(),), (idle,), (replica("r", "m", last_used_at=NOW - 1200),)), plan)
    assert [r.state for r in after.replicas] == ["sleeping"] and schedule(after).empty


def test_a_replica_that_cannot_sleep_or_was_not_asked_for_lately_is_stopped():
    stale = model("m", last_requested_at=NOW - 7200)
    plan = schedule(Snapshot(NOW, (gpu_node(),), (stale,), (replica("r", "m", last_used_at=NOW - 7200),)))
    assert [(e.reason, e.sleep) for e in plan.evictions] == [("idle", False)]
    recent = model("m", last_requested_at=NOW - 1200)
    plan = schedule(Snapshot(NOW, (gpu_node(),), (recent,), (replica("r", "m", host=0, last_used_at=NOW - 1200),)))
    assert [(e.reason, e.sleep) for e in plan.evictions] == [("idle", False)]  # llama.cpp: no sleep mode


def test_no_room_in_host_memory_for_its_weights_means_it_is_stopped():
    recent = model("m", last_requested_at=NOW - 1200)
    resident = replica("r", "m", host=16, last_used_at=NOW - 1200)
    plan = schedule(Snapshot(NOW, (gpu_node(ram=8),), (recent,), (resident,)))
    assert [e.sleep for e in plan.evictions] == [False]


def test_a_preempted_replica_asked_for_recently_sleeps_and_the_decision_says_so():
    victim = model("low", priority=1, last_requested_at=NOW - 300, capacity_class="opportunistic")
    wanted = model("high", count=1, priority=10, capacity_class="critical")
    snap = Snapshot(NOW, (gpu_node(),), (victim, wanted), (replica("r", "low", last_used_at=NOW - 300),))
    plan = schedule(snap)
    [eviction] = plan.evictions
    assert (eviction.reason, eviction.sleep, eviction.beneficiary) == ("preempted", True, "high")
    [decision] = [d for d in plan.decisions if d.verdict == "preempted"]
    assert "sleep" in decision.codes and "put to sleep, not stopped" in decision.detail
    assert [l.model for l in plan.launches] == ["high"]


def test_a_request_waiting_wakes_the_sleeping_replica_where_its_gpu_has_room():
    waiting = model("m", waiting=1, last_requested_at=NOW)
    asleep = replica("r", "m", state="sleeping", ready_since=None)
    snap = Snapshot(NOW, (gpu_node(),), (waiting,), (asleep,))
    plan = schedule(snap)
    assert [(w.replica, w.node) for w in plan.wakes] == [("r", "a")] and not plan.launches
    assert any(d.codes == ("wake",) for d in plan.decisions)
    assert schedule(apply(snap, plan)).empty  # woken: starting, nothing more to do


def test_when_its_gpu_was_taken_meanwhile_a_new_replica_is_launched_elsewhere():
    waiting = model("m", waiting=1, last_requested_at=NOW)
    other = model("x", count=1)
    nodes = (gpu_node("a"), gpu_node("b"))
    snap = Snapshot(NOW, nodes, (waiting, other),
                    (replica("r", "m", state="sleeping", ready_since=None), replica("x1", "x", node="a", host=0)))
    plan = schedule(snap)
    assert not plan.wakes and [(l.model, l.node) for l in plan.launches] == [("m", "b")]


def test_nothing_wakes_a_sleeping_replica_nobody_waits_for_and_past_the_window_it_is_stopped():
    asleep = replica("r", "m", state="sleeping", ready_since=None)
    quiet = Snapshot(NOW, (gpu_node(),), (model("m", last_requested_at=NOW - 1200),), (asleep,))
    assert schedule(quiet).empty
    stale = dataclasses.replace(quiet, models=(model("m", last_requested_at=NOW - 4000),))
    plan = schedule(stale)
    assert [(e.replica, e.reason, e.sleep) for e in plan.evictions] == [("r", "idle", False)]
    gone = dataclasses.replace(quiet, models=())
    assert [e.reason for e in schedule(gone).evictions] == ["not-desired"]


def test_a_sleeping_replica_holds_host_memory_not_device_memory():
    asleep = replica("r", "m", state="sleeping", ready_since=None, host=200)
    cpu_model = DesiredModel("c", (Profile("cpu", "vllm", 0, 100 * G, cpu_cores=2),), Scaling(min=1))
    gpu_model = model("g", gib=70, count=1)
    wanted = (model("m", last_requested_at=NOW - 60), cpu_model, gpu_model)
    snap = Snapshot(NOW, (gpu_node(ram=256),), wanted, (asleep,))
    plan = schedule(snap)
    assert [l.model for l in plan.launches] == ["g"]  # its GPU is free while it sleeps
    assert [u.model for u in plan.unschedulable] == ["c"]  # 200 of 256 GiB of RAM hold its weights


def test_the_sleep_window_is_a_setting():
    recent = model("m", last_requested_at=NOW - 1200)
    snap = Snapshot(NOW, (gpu_node(),), (recent,), (replica("r", "m", last_used_at=NOW - 1200),),
                    settings=Settings(sleep_window_s=600))
    assert [e.sleep for e in schedule(snap).evictions] == [False]


@st.composite
def with_sleepers(draw):
    """A random resident state (the policy properties'), some of its GPU replicas able to sleep and
    some asleep, their models asked for at random moments."""
    snap = draw(snapshots())
    replicas = []
    for r in snap.replicas:
        if r.accelerators and draw(st.booleans()):
            r = dataclasses.replace(r, sleep_host_bytes=draw(st.sampled_from([1, 8, 30])) * G)
            if draw(st.booleans()):
                r = dataclasses.replace(r, state="sleeping", ready_since=None, active_requests=0)
        replicas.append(r)
    moments = st.sampled_from([None, snap.now - 60, snap.now - 9000])
    models = tuple(dataclasses.replace(m, last_requested_at=draw(moments)) for m in snap.models)
    return dataclasses.replace(snap, replicas=tuple(replicas), models=models)


@PROPS
@given(with_sleepers())
def test_sleep_keeps_the_policy_deterministic_and_converging(snap):
    plan = schedule(snap)
    assert schedule(dataclasses.replace(snap, replicas=snap.replicas[::-1], models=snap.models[::-1])) == plan
    by_id = {r.id: r for r in snap.replicas}
    for eviction in plan.evictions:
        if eviction.sleep:  # only what can sleep, awake, of a model asked for within the window
            replica = by_id[eviction.replica]
            assert replica.sleep_host_bytes and replica.state != "sleeping"
    for wake in plan.wakes:
        assert by_id[wake.replica].state == "sleeping"
    after = apply(snap, plan)
    again = schedule(after)
    assert again.launches == () and again.evictions == () and again.wakes == (), (plan, again)
