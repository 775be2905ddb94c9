"""The recovery ladder's last rung, pure (no database): after the degraded relaunch, a model with no
fallback is launched once at the minimal footprint (level 2) and parked when that fails too; a model
with a fallback falls back as before."""

import dataclasses

import pytest

from scheduler.policy import recovery
from scheduler.policy.inputs import GIB, DesiredModel, NodeInfo, Profile, Scaling, Snapshot
from scheduler.policy.plan import schedule

NOW = 100_000.0
LONG_AGO = NOW - 3600  # past any backoff


def llm(fallbacks=()):
    return DesiredModel("m", (Profile("default", "llamacpp", 0, 4 * GIB, cpu_cores=2),), fingerprint="f1",
                        fallbacks=fallbacks)


def failures(*kinds, fallback=False):
    state = None
    for kind in kinds:
        state = recovery.record_failure(state, kind, LONG_AGO, f"{kind} while loading", fingerprint="f1",
                                        fallback=fallback)
    return state


def test_without_a_fallback_the_fallback_rung_is_the_minimal_footprint():
    assert [recovery.ladder("oom", n, fallback=False) for n in (1, 2, 3)] == ["degrade", "minimal", "quarantine"]
    assert [recovery.ladder("hang", n, fallback=False) for n in (1, 2, 3, 4)] == [
        "retry", "degrade", "minimal", "quarantine"]
    assert [recovery.ladder("oom", n, fallback=True) for n in (1, 2, 3)] == ["degrade", "fallback", "quarantine"]
    for kind in ("oom", "hang", "crash"):  # severity still never decreases
        sev = [recovery.SEVERITY[recovery.ladder(kind, n, fallback=False)] for n in range(1, 8)]
        assert sev == sorted(sev)


@pytest.mark.parametrize("kinds", [("oom", "oom"), ("hang", "hang", "hang")])
def test_after_the_degraded_relaunch_failed_the_next_launch_is_minimal_and_says_why(kinds):
    state = failures(*kinds)
    assert not state.parked and state.level == recovery.MINIMAL_FOOTPRINT
    step = recovery.next_step(llm(), state)
    assert (step.action, step.level, step.fallback, step.parked) == (recovery.MINIMAL, 2, False, False)
    assert "minimal footprint" in step.reason and "no fallback" in step.reason
    assert f"{kinds[-1]} while loading" in step.reason
    degraded = recovery.next_step(llm(), failures(*kinds[:-1]))
    assert (degraded.action, degraded.level) == (recovery.DEGRADE, 1) and "degraded relaunch" in degraded.reason


def test_the_plan_launches_the_minimal_footprint_once_then_parks():
    node = NodeInfo("cpu-1", engines=frozenset({"llamacpp"}), cpu_count=8, memory_bytes=32 * GIB)
    state = failures("oom", "oom")
    [launch] = schedule(Snapshot(NOW, (node,), (llm(),), failures={"m": state})).launches
    assert (launch.model, launch.level, launch.serves_for) == ("m", 2, "")
    for last in ("oom", "crash", "hang"):  # the minimal launch failed, however: the last rung is spent
        parked = recovery.record_failure(state, last, NOW - 10, "still out of memory", fingerprint="f1")
        assert parked.parked and parked.parked_fingerprint == "f1"
        plan = schedule(Snapshot(NOW, (node,), (llm(),), failures={"m": parked}))
        assert not plan.launches and plan.unschedulable[0].code == "parked"
        assert "still out of memory" in plan.unschedulable[0].reason


def test_with_a_fallback_the_fallback_is_launched_degraded_not_the_minimal_footprint():
    small = DesiredModel("small", (Profile("default", "llamacpp", 0, 1 * GIB, cpu_cores=1),), fingerprint="fs",
                         scaling=Scaling(min=0))
    node = NodeInfo("cpu-1", engines=frozenset({"llamacpp"}), cpu_count=8, memory_bytes=32 * GIB)
    state = failures("oom", "oom", fallback=True)
    assert state.level == recovery.DEGRADED and not state.parked
    [launch] = schedule(Snapshot(NOW, (node,), (llm(fallbacks=("small",)), small), failures={"m": state})).launches
    assert (launch.serves_for, launch.level) == ("small", 1)
    assert recovery.record_failure(state, "oom", NOW, fingerprint="f1", fallback=True).parked


def test_a_crash_after_the_degraded_relaunch_is_retried_degraded_not_minimal():
    state = failures("oom", "crash")
    step = recovery.next_step(llm(), state)
    assert (step.action, step.level) == (recovery.RETRY, 1)  # the level reached is kept; crashes have no rung


def test_a_gpu_model_reaching_the_last_rung_is_placed_on_the_cpu_where_its_engine_can():
    from scheduler.policy.inputs import AcceleratorInfo

    gpu = Profile("gpu", "llamacpp", 1, 6 * GIB)
    cpu_sized = Profile("gpu", "llamacpp", 0, 6 * GIB)  # what Serving supplies as the minimal footprint
    model = DesiredModel("m", (gpu,), fingerprint="f1", minimal=(cpu_sized,))
    node = NodeInfo("box", engines=frozenset({"llamacpp"}), cpu_count=8, memory_bytes=32 * GIB,
                    accelerators=(AcceleratorInfo("gpu-0", 0, memory_bytes=8 * GIB),))
    degraded = schedule(Snapshot(NOW, (node,), (model,), failures={"m": failures("oom")}))
    [on_gpu] = degraded.launches
    assert on_gpu.level == 1 and on_gpu.accelerators == ("gpu-0",)  # the degraded relaunch stays on its GPU
    [minimal] = schedule(Snapshot(NOW, (node,), (model,), failures={"m": failures("oom", "oom")})).launches
    assert minimal.level == 2 and minimal.accelerators == ()  # the last rung: host memory, no GPU
    without = dataclasses.replace(model, minimal=())
    [as_is] = schedule(Snapshot(NOW, (node,), (without,), failures={"m": failures("oom", "oom")})).launches
    assert as_is.accelerators == ("gpu-0",)  # a model Serving gives no minimal footprint keeps its profile
