"""The placement index and the exact search for small batches (no database)."""

import random

from scheduler.policy.inputs import GIB, AcceleratorInfo, DesiredModel, NodeInfo, Profile, ReplicaInfo, Snapshot
from scheduler.policy.placement import Fleet, Placer
from scheduler.policy.plan import apply, schedule

G = GIB


def _random_fleet(rnd):
    nodes = []
    for n in range(rnd.randint(1, 6)):
        accs = tuple(AcceleratorInfo(f"n{n}g{i}", i, rnd.choice(["h100", "l40"]), rnd.choice([24, 48, 80]) * G,
                                     mig=rnd.random() < 0.1, placeable=rnd.random() < 0.95)
                     for i in range(rnd.choice([0, 1, 2, 4])))
        nodes.append(NodeInfo(f"n{n}", state=rnd.choice(["ready"] * 5 + ["cordoned"]),
                              engines=frozenset({"vllm", "llamacpp"}), cpu_count=rnd.choice([8, 16, None]),
                              memory_bytes=rnd.choice([32, 64]) * G, accelerators=accs,
                              weights=frozenset(rnd.sample(["w0", "w1", "w2"], rnd.randint(0, 2)))))
    return nodes


def test_the_index_picks_the_same_spot_as_checking_every_node():
    """best_spot through the index (groups of interchangeable nodes, best fit walking up from the
    size needed) answers exactly what a scan of every node answers, as the fleet changes and is copied."""
    for seed in range(400):
        rnd = random.Random(seed)
        fleet, placer = Fleet(_random_fleet(rnd)), Placer()
        models = [DesiredModel(f"m{i}", (Profile("p", "vllm", rnd.choice([0, 1, 1, 2]), rnd.choice([4, 8, 16, 30]) * G,
                                                 cpu_cores=rnd.choice([0, 2]),
                                                 accelerator_class=rnd.choice(["", "h100"])),),
                               weights_key=rnd.choice(["", "w0", "w1"])) for i in range(8)]
        for step in range(25):
            m = rnd.choice(models)
            fast = placer.best_spot(fleet, m, m.profiles[0])
            full = placer.best_spot(fleet, m, m.profiles[0], reasons=[])
            assert (fast and (fast.node, fast.accelerators, fast.key)) == (full and (full.node, full.accelerators, full.key)), seed
            if fast:
                fleet.add(ReplicaInfo(f"r{step}", m.id, "p", fast.node, fast.accelerators, fast.memory_bytes,
                                      fast.cpu_cores))
            if fleet.replicas and rnd.random() < 0.3:
                fleet.remove(rnd.choice(sorted(fleet.replicas)))
            if rnd.random() < 0.2:
                fleet = fleet.copy()


def test_the_index_looks_at_one_node_per_group_not_every_node():
    nodes = tuple(NodeInfo(f"n{i:03d}", engines=frozenset({"vllm"}),
                           accelerators=tuple(AcceleratorInfo(f"n{i}g{j}", j, "h100", 80 * G) for j in range(8)))
                  for i in range(200))
    models = tuple(DesiredModel(f"m{i:02d}", (Profile("p", "vllm", 1, 20 * G),)) for i in range(40))
    placer = Placer()
    fleet = Fleet(nodes)
    for m in models:
        spot = placer.best_spot(fleet, m, m.profiles[0])
        fleet.add(ReplicaInfo(f"r-{m.id}", m.id, "p", spot.node, spot.accelerators, spot.memory_bytes))
    assert placer.detailed_checks < 40 * 5  # a scan would make 40 × 200
    plan = schedule(Snapshot(0.0, nodes, models))
    assert len(plan.launches) == 40 and schedule(apply(Snapshot(0.0, nodes, models), plan)).empty


def test_a_small_batch_that_does_not_fit_is_packed_exactly():
    # One 10 GiB GPU: worth-per-byte and worth orders both take "a" (7 for 6 GiB) and stop there;
    # b and c (5 + 5 for 10 GiB) are worth more. The bounded exact search finds them.
    node = NodeInfo("n", engines=frozenset({"vllm"}), accelerators=(AcceleratorInfo("g0", 0, "h100", 10 * G),))
    models = (DesiredModel("a", (Profile("p", "vllm", 1, 6 * G),), priority=7),
              DesiredModel("b", (Profile("p", "vllm", 1, 5 * G),), priority=5),
              DesiredModel("c", (Profile("p", "vllm", 1, 5 * G),), priority=5))
    snap = Snapshot(0.0, (node,), models)
    plan = schedule(snap)
    assert sorted(l.model for l in plan.launches) == ["b", "c"]
    assert [u.model for u in plan.unschedulable] == ["a"] and "fits nowhere" in plan.unschedulable[0].reason
    assert schedule(snap) == plan  # deterministic: the search has a node budget, not a time limit
    assert schedule(apply(snap, plan)).empty
