"""Placement decisions as evidence: rows for a recorded plan, explain and headroom dry runs, the
bounded history, and the inventory snapshot built from scheduler's rows."""

import pytest

from scheduler import memory
from scheduler.models import PlacementDecision
from scheduler.placement_service import explain_placement, headroom, record_plan, trim_history
from scheduler.policy.inputs import GIB, DesiredModel, Profile, Scaling
from scheduler.policy.plan import schedule
from scheduler.snapshot import current_snapshot, inventory

pytestmark = pytest.mark.django_db


def llm(mid="llama-70b", gib=60, gpus=1, **kw):
    return DesiredModel(mid, (Profile("default", "vllm", gpus, gib * GIB),), **kw)


def test_inventory_reads_nodes_gpus_and_mig_instances_from_scheduler_rows(h100_node, mig_node, cpu_node):
    nodes = {n.name: n for n in inventory()}
    assert len(nodes["h100-01"].accelerators) == 8 and "vllm" in nodes["h100-01"].engines
    assert all(a.memory_bytes and a.memory_bytes < 81 * GIB for a in nodes["h100-01"].accelerators)
    accs = nodes["a100-01"].accelerators
    assert any(a.mig for a in accs)  # cards in MIG mode give way to their instances
    assert not any(a.accelerator_class == "a100-80g" and a.mig for a in accs)
    assert nodes["cpu-01"].accelerators == () and nodes["cpu-01"].memory_bytes > 0


def test_a_recorded_plan_leaves_one_row_per_model_with_digest_and_fingerprint(h100_node):
    snap = current_snapshot((llm("a"), llm("b", gib=70, gpus=8, scaling=Scaling(min=2))), now=1000.0)
    plan = schedule(snap)
    rows = record_plan(snap, plan)
    by_model = {r.model: r for r in PlacementDecision.objects.all()}
    assert len(rows) == 2
    assert by_model["a"].verdict == "placed" and by_model["a"].node == "h100-01" and len(by_model["a"].accelerators) == 1
    assert by_model["b"].verdict == "unschedulable" and by_model["b"].reason_codes == ["no-fit"]
    assert by_model["a"].inputs_digest == snap.digest() and by_model["a"].fingerprint == plan.fingerprint()
    assert by_model["a"].headroom_before_bytes > by_model["a"].headroom_after_bytes


def test_reservations_count_against_the_room_a_dry_run_sees(h100_node):
    gpu = h100_node.accelerators.order_by("index").first()
    free = memory.budget_for(h100_node, gpu).free_for_new
    memory.reserve_memory(h100_node, "replica:x", free, accelerator=gpu)
    snap = current_snapshot((llm("small", gib=30),), now=1000.0)
    # One replica of a model per GPU (spread): the card reserved in full takes nothing, one GPU takes
    # the pending launch, every other GPU with 30 GiB free one more.
    fits = sum(1 for a in snap.nodes[0].accelerators if a.memory_bytes >= 30 * GIB)
    answer = headroom(snap, "small", limit=64)
    assert answer["more"] == fits - 1
    assert "would fit only on a GPU that already runs one of its replicas" in answer["blocked"]
    row = PlacementDecision.objects.get(kind="headroom")
    assert row.verdict == "dry-run" and row.evidence["more"] == fits - 1


def test_explain_lists_per_profile_and_node_why_it_was_rejected(h100_node, cpu_node):
    answer = explain_placement(current_snapshot((llm("huge", gib=200),), now=1000.0), "huge")
    reasons = {r["node"]: r["reason"] for r in answer["rows"]}
    assert "needs 1" in reasons["h100-01"]
    assert "no vllm engine" in reasons["cpu-01"]
    assert not answer["fits_somewhere"] and answer["pending"]["code"] == "no-fit"
    assert PlacementDecision.objects.filter(kind="explain", model="huge").exists()


def test_history_is_bounded(settings, h100_node):
    settings.SCHEDULER_DECISION_HISTORY = 5
    snap = current_snapshot((llm("a"),), now=1000.0)
    for _ in range(4):
        record_plan(snap, schedule(snap))
        headroom(snap, "a")
    trim_history()
    assert PlacementDecision.objects.count() == 5


MODEL = {"model": "llama-8b", "profiles": [{"name": "gpu", "engine": "vllm", "gpus": 1, "memory_gib": 30}], "min": 1}


def test_api_explain_and_headroom_answer_for_a_model_shape(client, admin_user, h100_node):
    client.force_login(admin_user)
    explain = client.post("/api/scheduler/placement/explain/", MODEL, content_type="application/json")
    assert explain.status_code == 200 and explain.json()["fits_somewhere"]
    room = client.post("/api/scheduler/placement/headroom/", {**MODEL, "limit": 4}, content_type="application/json")
    assert room.json()["more"] == 4 and room.json()["blocked"] == "stopped counting at 4"
    history = client.get("/api/scheduler/decisions/?kind=headroom").json()
    rows = history["results"] if isinstance(history, dict) else history
    assert [r["model"] for r in rows] == ["llama-8b"]


def test_api_refuses_max_below_min(client, admin_user):
    client.force_login(admin_user)
    response = client.post("/api/scheduler/placement/headroom/", {**MODEL, "min": 2, "max": 1},
                           content_type="application/json")
    assert response.status_code == 400


def test_api_lists_parked_and_unplaceable_models(client, admin_user, h100_node):
    client.force_login(admin_user)
    snap = current_snapshot((llm("too-big", gib=500),), now=1000.0)
    record_plan(snap, schedule(snap))
    answer = client.get("/api/scheduler/placement/parked/").json()
    assert [r["model"] for r in answer["unplaceable"]] == ["too-big"] and answer["parked"] == []


def test_console_shows_decisions_with_filters_and_the_unplaceable_list(client, admin_user, h100_node):
    client.force_login(admin_user)
    snap = current_snapshot((llm("fits"), llm("too-big", gib=500)), now=1000.0)
    record_plan(snap, schedule(snap))
    page = client.get("/fleet/placement/?verdict=unschedulable").content.decode()
    assert "too-big" in page and "fits nowhere" in page
    fragment = client.get("/fleet/placement/?model=fits", HTTP_HX_REQUEST="true").content.decode()
    assert "fits" in fragment and "<html" not in fragment
