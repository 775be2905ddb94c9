"""Spread and placement constraints in the pure policy: never two replicas of a model on one GPU
(a MIG instance counts as its card), nodes before accelerators, classes as families, refusals that
name the constraint."""

from scheduler.policy.inputs import (
    GIB, AcceleratorInfo, DesiredModel, NodeInfo, Profile, ReplicaInfo, Scaling, Snapshot,
)
from scheduler.policy.placement import class_matches
from scheduler.policy.plan import SPREAD, apply, explain, schedule

G = GIB
NOW = 100_000.0


def gpu_node(name, gpus=2, mem=80, cls="h100-80g", **kw):
    accs = tuple(AcceleratorInfo(f"{name}-g{i}", i, cls, mem * G) for i in range(gpus))
    kw.setdefault("engines", frozenset({"vllm", "llamacpp"}))
    return NodeInfo(name, cpu_count=64, memory_bytes=256 * G, accelerators=accs, **kw)


def mig_node(name, cards=1, instances=3):
    accs = tuple(AcceleratorInfo(f"{name}-c{c}-mig{j}", c, "a100-80g-mig-2g.20gb", 20 * G, mig=True,
                                 card=f"{name}-c{c}")
                 for c in range(cards) for j in range(instances))
    return NodeInfo(name, engines=frozenset({"vllm"}), cpu_count=64, memory_bytes=256 * G, accelerators=accs)


def model(mid, gib=10, gpus=1, count=2, **kw):
    profile = kw.pop("profile", None) or Profile("default", "vllm", gpus, gib * G)
    return DesiredModel(mid, (profile,), Scaling(min=count), **kw)


def test_a_second_replica_goes_to_another_node_before_another_gpu():
    plan = schedule(Snapshot(NOW, (gpu_node("a"), gpu_node("b")), (model("m"),)))
    assert sorted(l.node for l in plan.launches) == ["a", "b"]


def test_replicas_on_one_node_take_different_gpus_and_the_one_left_over_is_refused_with_the_spread_code():
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=2),), (model("m", count=3),)))
    assert len(plan.launches) == 2
    assert len({l.accelerators for l in plan.launches}) == 2  # 10 GiB of 80: all three would fit on one card
    [refused] = plan.unschedulable
    assert refused.code == SPREAD and refused.missing == 1
    assert "already runs one of its replicas" in refused.reason and "a-g" not in refused.reason
    decision = next(d for d in plan.decisions if d.verdict == "unschedulable")
    assert decision.codes == (SPREAD,) and decision.detail == refused.reason


def test_two_mig_instances_of_one_card_are_one_gpu_for_spread():
    plan = schedule(Snapshot(NOW, (mig_node("a", cards=1),), (model("m", count=2),)))
    assert len(plan.launches) == 1 and plan.unschedulable[0].code == SPREAD
    plan = schedule(Snapshot(NOW, (mig_node("a", cards=2),), (model("m", count=2),)))
    cards = {l.accelerators[0].rsplit("-mig", 1)[0] for l in plan.launches}
    assert len(plan.launches) == 2 and cards == {"a-c0", "a-c1"}


def test_other_models_may_share_a_gpu_and_cpu_replicas_share_a_node():
    nodes = (gpu_node("a", gpus=1, engines=frozenset({"vllm"})),
             NodeInfo("cpu", engines=frozenset({"llamacpp"}), cpu_count=32, memory_bytes=64 * G))
    cpu = Profile("cpu", "llamacpp", 0, 4 * G, cpu_cores=2)
    plan = schedule(Snapshot(NOW, nodes, (model("x", count=1), model("y", count=1), model("c", count=3, profile=cpu))))
    on_gpu = [l for l in plan.launches if l.accelerators]
    assert sorted(l.model for l in on_gpu) == ["x", "y"] and {l.accelerators for l in on_gpu} == {("a-g0",)}
    # CPU replicas have no GPU to spread over: three on the one CPU node.
    assert [l.node for l in plan.launches if l.model == "c"] == ["cpu"] * 3 and not plan.unschedulable


def test_a_resident_replica_keeps_its_gpu_from_the_models_next_replica():
    resident = ReplicaInfo("r1", "m", "default", "a", ("a-g0",), 10 * G, ready_since=NOW - 60)
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=2),), (model("m", count=3),), (resident,)))
    assert [l.accelerators for l in plan.launches] == [("a-g1",)]
    assert schedule(apply(Snapshot(NOW, (gpu_node("a", gpus=2),), (model("m", count=3),), (resident,)), plan)).empty


def test_tensor_parallel_replicas_of_a_model_never_share_a_gpu():
    plan = schedule(Snapshot(NOW, (gpu_node("a", gpus=4),), (model("m", gpus=2, count=3),)))
    used = [a for l in plan.launches for a in l.accelerators]
    assert len(plan.launches) == 2 and len(used) == len(set(used)) == 4
    assert plan.unschedulable[0].code == SPREAD


def test_explain_marks_a_node_refused_only_by_spread():
    snap = Snapshot(NOW, (gpu_node("a", gpus=1), gpu_node("b", gpus=1, mem=8)), (model("m", count=1),))
    rows = {r["node"]: r for r in explain(snap, "m")}
    assert rows["a"]["code"] == SPREAD and "already run a replica of m" in rows["a"]["reason"]
    assert rows["b"]["code"] == "rejected"


def test_an_accelerator_class_names_a_family_and_a_list_takes_any_of_them():
    assert class_matches(("h100",), "h100-80g") and class_matches(("H100",), "h100-94g")
    assert class_matches(("h100-80g",), "h100-80g-mig-3g.40gb") and not class_matches(("h100",), "h1000-80g")
    assert class_matches(("a100", "h100"), "h100-80g") and not class_matches(("a100",), "l40s-48g")
    assert class_matches((), "anything")
    nodes = (gpu_node("l", cls="l40s-48g", mem=48), gpu_node("h", cls="h100-80g"), gpu_node("x", cls="a100-80g"))
    plan = schedule(Snapshot(NOW, nodes, (model("m", count=2, profile=Profile("p", "vllm", 1, 10 * G,
                                                                          accelerator_class=("h100", "a100"))),)))
    assert sorted(l.node for l in plan.launches) == ["h", "x"]


def test_a_class_no_node_has_is_refused_by_name():
    plan = schedule(Snapshot(NOW, (gpu_node("a", cls="l40s-48g"),),
                             (model("m", count=1, profile=Profile("p", "vllm", 1, 10 * G, accelerator_class="h100")),)))
    [refused] = plan.unschedulable
    assert refused.code == "accelerator-class"
    assert refused.reason.startswith("profile p needs accelerator class h100; no ready node has one")


def test_a_class_whose_gpus_are_full_says_none_is_free():
    full = ReplicaInfo("r1", "other", "default", "a", ("a-g0",), 75 * G, ready_since=NOW - 60, pinned=True)
    snap = Snapshot(NOW, (gpu_node("a", gpus=1), gpu_node("b", gpus=1, cls="l40s-48g", mem=48)),
                    (model("m", count=1, profile=Profile("p", "vllm", 1, 10 * G, accelerator_class="h100")),), (full,))
    [refused] = schedule(snap).unschedulable
    assert refused.code == "no-fit"
    assert refused.reason.startswith("profile p needs accelerator class h100; no node has one free")


def test_a_node_selector_places_only_on_labelled_nodes_and_names_the_label_otherwise():
    nodes = (gpu_node("a", labels={"zone": "a"}), gpu_node("b", labels={"zone": "b"}))
    wanted = Profile("p", "vllm", 1, 10 * G, node_selector={"zone": "a"})
    plan = schedule(Snapshot(NOW, nodes, (model("m", count=2, profile=wanted),)))
    assert [l.node for l in plan.launches] == ["a", "a"]
    lost = Profile("p", "vllm", 1, 10 * G, node_selector={"zone": "c"})
    [refused] = schedule(Snapshot(NOW, nodes, (model("m", count=1, profile=lost),))).unschedulable
    assert refused.code == "node-selector" and refused.reason.startswith("profile p needs label zone=c;")


def test_a_profile_that_refuses_mig_is_not_placed_on_instances():
    wanted = Profile("p", "vllm", 1, 10 * G, allow_mig=False)
    plan = schedule(Snapshot(NOW, (mig_node("a"), gpu_node("b", gpus=1)), (model("m", count=1, profile=wanted),)))
    assert [l.node for l in plan.launches] == ["b"]


def test_min_disk_refuses_a_node_without_room_unless_it_holds_the_weights():
    wanted = Profile("p", "vllm", 1, 10 * G, min_disk_bytes=50 * G)
    nodes = (gpu_node("a", disk_free_bytes=10 * G),
             gpu_node("b", disk_free_bytes=10 * G, weights=frozenset({"hub/m.gguf"})))
    plan = schedule(Snapshot(NOW, nodes, (model("m", count=1, profile=wanted, weights_key="hub/m.gguf"),)))
    assert [l.node for l in plan.launches] == ["b"]
    plan = schedule(Snapshot(NOW, nodes, (model("m", count=1, profile=wanted, weights_key="other"),)))
    assert "of disk free, needs 50.0 GiB" in plan.unschedulable[0].reason
