"""A held model's placement: where it runs (ready of wanted, starting, nodes) and its state (parked,
unplaceable, idle) on Held; the room for more on its card (Scheduler II's headroom, the fit planner
per node where that cannot be asked); the min/max form refused when placement cannot meet it (the rest
of the placement form: test_catalog_placement)."""

from __future__ import annotations

import pytest

from berth.errors import BerthError
from scheduler.models import MemoryReservation, Node, PlacementDecision
from scheduler.services import EngineReport, NodeReport, register_node
from serving.catalog import entries, room
from serving.catalog.errors import ScalingRefused
from serving.models import Deployment, Replica
from tenancy.audit import Actor
from tests.assets.hub_server import mirror_root  # noqa: F401  (fixture)

ADMIN = Actor(system="tests")
pytestmark = pytest.mark.django_db


@pytest.fixture
def held(mirror_root, tiny_model):
    return entries.import_local(ADMIN, tiny_model, name="tiny-held")


@pytest.fixture
def per_replica(held):
    model = room.desired_model(held)
    assert model is not None and model.profiles[0].gpus == 0  # a GGUF on llama.cpp: a CPU profile
    return model.profiles[0].memory_bytes


@pytest.fixture
def two_fit(settings, per_replica):
    """One CPU node with room for exactly two replicas of the held model."""
    settings.SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = 0
    total = per_replica * 5 // 2
    return register_node(NodeReport(name="cpu-01", address="127.0.0.1", cpu_count=16, memory_total_bytes=total,
                                    memory_available_bytes=total,
                                    engines=(EngineReport(kind="llamacpp", version="b1"),)))


def entry_of(user, held):
    from serving.catalog.queries import held_entries

    return next(e for e in held_entries(user) if e.pk == held.pk)


def run_replica(held, node, state="ready", port=20001):
    deployment = Deployment.objects.filter(name=held.name).first() or Deployment.objects.create(
        name=held.name, model_path=str(entries.served_path(held)), node=node, state="ready")
    replica = Replica.objects.create(deployment=deployment, node=node, port=port, state=state)
    return deployment, replica


def test_headroom_counts_how_many_more_fit_and_where(admin_user, held, two_fit, per_replica):
    answer = room.room_for_more(entry_of(admin_user, held))
    assert (answer.source, answer.more, answer.nodes) == ("headroom", 2, {"cpu-01": 2})
    assert answer.per_replica_bytes == per_replica and answer.blocked
    # A replica's reservation takes one spot: one more fits.
    MemoryReservation.objects.create(node=two_fit, holder="replica:x", bytes=per_replica)
    assert room.room_for_more(entry_of(admin_user, held)).more == 1


def test_the_fit_planner_answers_per_node_when_headroom_cannot_be_asked(admin_user, held, two_fit, monkeypatch):
    from scheduler import placement_service

    def unavailable(*args, **kwargs):
        raise BerthError("Scheduler II is not fed yet.")

    monkeypatch.setattr(placement_service, "headroom", unavailable)
    answer = room.room_for_more(entry_of(admin_user, held))
    assert (answer.source, answer.more, answer.nodes) == ("fit planner", 2, {"cpu-01": 2})


def test_the_card_shows_the_room_for_more(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    card = client.get(f"/models/held/{held.public_id}/")
    assert card.status_code == 200
    assert b"Room for more" in card.content and b'data-more="2"' in card.content and b"2 on cpu-01" in card.content


def test_a_minimum_placement_cannot_meet_is_refused_with_the_reason(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    refused = client.post(f"/models/held/{held.public_id}/", {"scaling_min": "3", "scaling_max": "3"}, follow=True)
    assert refused.status_code == 409
    assert b"at least 3 cannot be met" in refused.content and b"2 more fit (2 on cpu-01)" in refused.content
    # Under the field it concerns, with what was typed still in the form.
    assert b'data-field="scaling_min"><li>Always running: tiny-held: at least 3' in refused.content
    assert b'name="scaling_min" min="0" value="3"' in refused.content
    held.refresh_from_db()
    assert (held.scaling_min, held.scaling_max) == (0, 1)
    assert PlacementDecision.objects.filter(kind="headroom", model="tiny-held").exists()  # the evidence
    accepted = client.post(f"/models/held/{held.public_id}/", {"scaling_min": "2", "scaling_max": "4"}, follow=True)
    assert b"at least 2, at most 4" in accepted.content
    held.refresh_from_db()
    assert (held.scaling_min, held.scaling_max) == (2, 4)


def test_what_runs_counts_toward_the_minimum(admin_user, held, two_fit, per_replica):
    run_replica(held, two_fit)
    MemoryReservation.objects.create(node=two_fit, holder="replica:1", bytes=per_replica)
    entry = entry_of(admin_user, held)
    room.check_scaling(entry, 2, 2)  # one runs, one more fits
    with pytest.raises(ScalingRefused) as refused:
        room.check_scaling(entry, 3, 3)
    assert refused.value.details["running"] == 1 and refused.value.details["more"] == 1
    room.check_scaling(entry, 0, 1)  # lowering needs no room


def test_max_below_min_is_refused(client, admin_user, held):
    client.force_login(admin_user)
    response = client.post(f"/models/held/{held.public_id}/", {"scaling_min": "2", "scaling_max": "1"}, follow=True)
    assert response.status_code == 400
    assert b'data-field="scaling_max"><li>At most under load: At least the minimum (2), not 1.' in response.content
    assert b'name="scaling_min" min="0" value="2"' in response.content


def test_held_says_where_each_model_runs_and_its_state(client, admin_user, held, two_fit, tiny_model):
    client.force_login(admin_user)
    idle = client.get("/models/held/").content.decode()
    assert "0 of 0 ready" in idle and ">idle<" in idle  # on demand, nothing runs
    deployment, _ = run_replica(held, two_fit)
    run_replica(held, two_fit, state="loading", port=20002)
    Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
    Replica.objects.create(deployment=deployment, node=two_fit, port=20003, state="stopped")  # not counted
    serving = client.get("/models/held/").content.decode()
    assert "1 of 2 ready, 1 starting" in serving and "cpu-01" in serving and ">serving<" in serving


def test_parked_and_unplaceable_come_from_the_placement_evidence(admin_user, held, mirror_root, tiny_model):
    other = entries.import_local(ADMIN, tiny_model, name="tiny-other")
    entries.save_entry(ADMIN, {"scaling_min": 1}, entry=other)
    PlacementDecision.objects.create(model="tiny-held", verdict="parked", detail="failed 5 times in a row",
                                     inputs_digest="d", fingerprint="f")
    PlacementDecision.objects.create(model="tiny-other", verdict="unschedulable", detail="fits nowhere",
                                     inputs_digest="d", fingerprint="f")
    from serving.catalog.queries import held_entries

    states = {e.name: e.placement for e in held_entries(admin_user)}
    assert states["tiny-held"]["state"] == "parked" and "5 times" in states["tiny-held"]["reason"]
    assert states["tiny-other"]["state"] == "unplaceable" and states["tiny-other"]["reason"] == "fits nowhere"


def test_api_room_answers_with_placement_and_headroom(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    answer = client.get(f"/api/serving/catalog/models/{held.public_id}/room/").json()
    assert answer["more"] == 2 and answer["nodes"] == {"cpu-01": 2} and answer["placement"]["state"] == "idle"


def test_no_node_means_no_room(admin_user, held):
    assert not Node.objects.exists()
    answer = room.room_for_more(entry_of(admin_user, held))
    assert answer.more == 0 and answer.nodes == {}
