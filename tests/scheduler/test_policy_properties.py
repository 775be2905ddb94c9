"""Properties of the placement policy over random fleets, catalogs and resident states (hypothesis)."""

import dataclasses
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from scheduler.policy.inputs import (
    CRITICAL, GIB, AcceleratorInfo, DesiredModel, NodeInfo, Profile, Resources, Scaling, ScopeContract, Snapshot,
)
from scheduler.policy.placement import Fleet
from scheduler.policy.plan import apply, schedule
from scheduler.policy.quotas import Quotas

G = GIB
CLASSES = ("", "critical", "standard", "opportunistic")
OWNERS = ("", "acme", "acme/a", "acme/b", "beta")


@st.composite
def snapshots(draw):
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    nodes = []
    for n in range(rnd.randint(1, 4)):
        gpus = rnd.choice([0, 1, 2, 4])
        accs = tuple(AcceleratorInfo(f"n{n}g{i}", i, rnd.choice(["h100", "l40"]), rnd.choice([24, 48, 80]) * G,
                                     mig=False) for i in range(gpus))
        if rnd.random() < 0.3:  # a card in MIG mode: its instances are the units, the card their failure domain
            card = f"n{n}card{gpus}"
            accs += tuple(AcceleratorInfo(f"{card}mig{j}", gpus, "a100-80g-mig-3g.40gb", rnd.choice([10, 20, 40]) * G,
                                          mig=True, card=card) for j in range(rnd.randint(2, 3)))
        nodes.append(NodeInfo(f"n{n}", state=rnd.choice(["ready"] * 5 + ["cordoned"]),
                              engines=frozenset({"vllm", "llamacpp"}), cpu_count=rnd.choice([8, 16, None]),
                              memory_bytes=rnd.choice([32, 64]) * G, accelerators=accs,
                              weights=frozenset({f"w{rnd.randint(0, 5)}"})))
    models = []
    for m in range(rnd.randint(1, 9)):
        profiles = []
        for p in range(rnd.randint(1, 2)):
            if rnd.random() < 0.3:
                profiles.append(Profile(f"cpu{p}", "llamacpp", 0, rnd.randint(1, 20) * G, cpu_cores=rnd.randint(1, 8)))
            else:
                profiles.append(Profile(f"gpu{p}", "vllm", rnd.choice([1, 1, 2]), rnd.randint(4, 60) * G,
                                        accelerator_class=rnd.choice(["", "h100", ("h100", "a100")]),
                                        allow_mig=rnd.random() < 0.8, priority=rnd.randint(0, 2)))
        low = rnd.choice([0, 1, 1, 2])
        models.append(DesiredModel(
            f"m{m}", tuple(profiles), Scaling(min=low, max=low + rnd.randint(0, 2), idle_timeout_s=600),
            capacity_class=rnd.choice(CLASSES), owner=rnd.choice(OWNERS), priority=rnd.randint(1, 10),
            pinned=rnd.random() < 0.1, weights_key=f"w{rnd.randint(0, 5)}", extra=rnd.randint(0, 1),
            last_requested_at=rnd.choice([None, 0.0, 9_500.0]), waiting=rnd.choice([0, 0, 1])))
    contracts = []
    if rnd.random() < 0.6:
        for path in ("acme", "acme/a", "acme/b"):
            if rnd.random() < 0.5:
                contracts.append(ScopeContract(path, guarantee=Resources(gpus=rnd.choice([None, 1, 2])),
                                               limit=Resources(gpus=rnd.choice([None, 2, 4]),
                                                               cores=rnd.choice([None, 8]))))
    snap = Snapshot(10_000.0, tuple(nodes), tuple(models), (), tuple(contracts))
    # A valid resident state: what an earlier pass placed, aged at random.
    earlier = apply(snap, schedule(snap))
    replicas = []
    for r in earlier.replicas:
        replicas.append(dataclasses.replace(
            r, id=f"r{len(replicas)}", state="ready", ready_since=rnd.choice([None, 9_990.0, 1_000.0]),
            created_at=rnd.choice([0.0, 500.0, 9_000.0]), last_used_at=rnd.choice([None, 100.0, 9_999.0]),
            active_requests=rnd.choice([0, 0, 0, 2]), pinned=rnd.random() < 0.1, load_seconds=rnd.choice([None, 20.0])))
    # Then the wishes change.
    changed = tuple(dataclasses.replace(m, priority=rnd.randint(1, 10), extra=rnd.randint(0, 1),
                                        scaling=dataclasses.replace(m.scaling, min=rnd.choice([0, 1, 1, 2])))
                    for m in models if rnd.random() < 0.9)
    extra_models = tuple(DesiredModel(f"x{i}", (Profile("p", "vllm", 1, rnd.randint(10, 70) * G),),
                                      capacity_class=rnd.choice(CLASSES), priority=rnd.randint(1, 10))
                         for i in range(rnd.randint(0, 3)))
    now = rnd.choice([10_000.0, 10_400.0])
    return Snapshot(now, tuple(nodes), changed + extra_models, tuple(replicas), tuple(contracts))


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(snapshots())
def test_schedule_is_deterministic_and_ignores_input_order(snap):
    plan = schedule(snap)
    assert schedule(snap) == plan
    shuffled = dataclasses.replace(snap, nodes=snap.nodes[::-1], models=snap.models[::-1], replicas=snap.replicas[::-1])
    assert schedule(shuffled) == plan


@PROPS
@given(snapshots())
def test_applying_a_plan_reaches_a_fixed_point(snap):
    plan = schedule(snap)
    after = apply(snap, plan)
    again = schedule(after)
    assert again.launches == () and again.evictions == (), (plan, again)
    assert schedule(apply(after, again)).empty


@PROPS
@given(snapshots())
def test_pinned_and_active_replicas_are_never_evicted(snap):
    pinned_models = {m.id for m in snap.models if m.pinned}
    by_id = {r.id: r for r in snap.replicas}
    for eviction in schedule(snap).evictions:
        replica = by_id[eviction.replica]
        assert not replica.pinned and replica.active_requests == 0 and replica.model not in pinned_models


@PROPS
@given(snapshots())
def test_launches_never_exceed_budgets(snap):
    after = apply(snap, schedule(snap))
    fleet = Fleet(after.nodes, after.replicas)
    assert all(free >= 0 for free in fleet.free_acc.values())
    assert all(free is None or free >= 0 for free in fleet.free_ram.values())
    assert all(free is None or free >= 0 for free in fleet.free_cores.values())
    nodes = {n.name: n for n in snap.nodes}
    for launch in schedule(snap).launches:
        assert nodes[launch.node].state == "ready"
        assert len(set(launch.accelerators)) == len(launch.accelerators)


@PROPS
@given(snapshots())
def test_launches_never_exceed_quota_limits(snap):
    plan = schedule(snap)
    owners = {m.id: m.owner for m in snap.models}
    before = Quotas(snap.contracts, owners, snap.replicas)
    after = Quotas(snap.contracts, owners, apply(snap, plan).replicas)
    for path, contract in after.contracts.items():
        held = after.held.get(path, [0, 0, 0])
        was = before.held.get(path, [0, 0, 0])
        for i, (_, limit) in enumerate(contract.limit.items()):
            if limit is not None and plan.launches:
                assert held[i] <= max(limit, was[i]) + 1e-9


@PROPS
@given(snapshots())
def test_a_critical_minimum_is_never_preempted(snap):
    models = {m.id: m for m in snap.models}
    plan = schedule(snap)
    for eviction in plan.evictions:
        if eviction.reason != "preempted":
            continue
        model = models[eviction.model]
        if model.effective_class != CRITICAL:
            continue
        ready = sorted((r for r in snap.replicas if r.model == model.id and r.ready_since is not None),
                       key=lambda r: (-r.created_at, r.id))
        position = [r.id for r in ready].index(eviction.replica)
        assert position < len(ready) - model.scaling.min


@PROPS
@given(snapshots())
def test_preemption_takes_at_most_three_victims_and_holds_their_models(snap):
    plan = schedule(snap)
    per_beneficiary = {}
    for e in plan.evictions:
        if e.reason == "preempted":
            per_beneficiary.setdefault(e.beneficiary, []).append(e)
            assert any(h.model == e.model for h in plan.holds)
    assert all(len(v) <= 3 for v in per_beneficiary.values())


def _cards(snap):
    """Accelerator id → its physical GPU (a MIG instance's parent card)."""
    return {a.id: a.card or a.id for n in snap.nodes for a in n.accelerators}


@PROPS
@given(snapshots())
def test_no_plan_puts_two_replicas_of_a_model_on_one_gpu(snap):
    """Spread: never two replicas of a model on one physical GPU (two MIG instances of one card
    count as one GPU), whatever the residents, quotas and preemption."""
    plan = schedule(snap)
    card = _cards(snap)
    gone = {e.replica for e in plan.evictions}
    used: dict[str, set] = {}
    for r in snap.replicas:
        if r.id not in gone:
            used.setdefault(r.model, set()).update(card.get(a, a) for a in r.accelerators)
    for launch in plan.launches:
        mine = {card[a] for a in launch.accelerators}
        assert len(mine) == len(launch.accelerators), launch  # a tensor-parallel replica's shards too
        assert not mine & used.get(launch.model, set()), (launch, used.get(launch.model))
        used.setdefault(launch.model, set()).update(mine)
    # And the state reached stays that way, pass after pass.
    after = apply(snap, plan)
    for r in schedule(after).launches:
        assert not {card[a] for a in r.accelerators} & used.get(r.model, set())



@st.composite
def crowded(draw):
    """A small fleet asked for more than it holds, several replicas per model, no quotas: the
    packer's swaps, exact search and repack all run (where a stacked replica would pay best)."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    nodes = []
    for n in range(rnd.randint(1, 2)):
        accs = tuple(AcceleratorInfo(f"n{n}g{i}", i, "h100-80g", rnd.choice([40, 80]) * G)
                     for i in range(rnd.randint(1, 3)))
        if rnd.random() < 0.5:
            accs += tuple(AcceleratorInfo(f"n{n}c9mig{j}", 9, "h100-80g-mig-3g.40gb", 40 * G, mig=True, card=f"n{n}c9")
                          for j in range(2))
        nodes.append(NodeInfo(f"n{n}", engines=frozenset({"vllm"}), cpu_count=64, memory_bytes=64 * G,
                              accelerators=accs))
    models = tuple(DesiredModel(f"m{m}", (Profile("p", "vllm", 1, rnd.choice([10, 20, 30, 40, 70]) * G),),
                                Scaling(min=rnd.randint(1, 3)), priority=rnd.randint(1, 12))
                   for m in range(rnd.randint(2, 7)))
    return Snapshot(10_000.0, tuple(nodes), models)


@PROPS
@given(crowded())
def test_the_packer_never_stacks_replicas_of_a_model_on_one_gpu(snap):
    card = _cards(snap)
    used: dict[str, set] = {}
    for launch in schedule(snap).launches:
        mine = {card[a] for a in launch.accelerators}
        assert not mine & used.get(launch.model, set()), launch
        used.setdefault(launch.model, set()).update(mine)
