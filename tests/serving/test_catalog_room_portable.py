"""Held, a model's card and its room read the placement evidence (the latest decision per model) on
either database: on the embedded default (SQLite, no DISTINCT ON) as on PostgreSQL. Run on both."""

from __future__ import annotations

import pytest

from scheduler.models import PlacementDecision
from serving.catalog import entries
from tenancy.audit import Actor
from tests.assets.hub_server import mirror_root  # noqa: F401  (fixture)

ADMIN = Actor(system="tests")
pytestmark = pytest.mark.django_db


@pytest.fixture
def owned(mirror_root, tiny_model, personas):
    """A model of acme/ml/search whose first decision placed it and whose latest found no room."""
    entry = entries.import_local(ADMIN, tiny_model, name="tiny-owned", owner=personas.acme.project)
    entries.save_entry(ADMIN, {"scaling_min": 1}, entry=entry)
    for verdict, detail in (("placed", "profile default on cpu-01"), ("unschedulable", "fits nowhere (1 rejections)")):
        PlacementDecision.objects.create(model=entry.name, verdict=verdict, detail=detail, inputs_digest="d",
                                         fingerprint="f")
    return entry


def test_held_the_card_and_the_room_answer_with_the_latest_verdict(client, personas, owned):
    client.force_login(personas.max)
    held = client.get("/models/held/")
    assert held.status_code == 200, held.content[:2000]
    assert b"tiny-owned" in held.content and b'title="unplaceable"' in held.content
    card = client.get(f"/models/held/{owned.public_id}/")
    assert card.status_code == 200 and b"fits nowhere" in card.content
    room = client.get(f"/api/serving/catalog/models/{owned.public_id}/room/")
    assert room.status_code == 200, room.content
    placement = room.json()["placement"]
    assert placement["state"] == "unplaceable" and placement["reason"].startswith("fits nowhere")


def test_another_org_sees_neither_the_model_nor_its_verdict(client, personas, owned):
    client.force_login(personas.oscar)
    held = client.get("/models/held/")
    assert held.status_code == 200 and b"tiny-owned" not in held.content and b"fits nowhere" not in held.content
    assert client.get(f"/api/serving/catalog/models/{owned.public_id}/room/").status_code == 404


def test_a_tenants_own_deployment_of_a_shared_models_file_is_shown_to_that_tenant_alone(mirror_root, tiny_model,
                                                                                         personas):
    from scheduler.services import NodeReport, register_node
    from serving.catalog import queries
    from serving.models import Deployment, Replica

    shared = entries.import_local(ADMIN, tiny_model, name="tiny-shared")
    node = register_node(NodeReport(name="cpu-held", address="127.0.0.1", cpu_count=4))
    path = shared.profiles[0]["file"]
    mine = Deployment.objects.create(name="acme-copy", model_path=path, node=node, owner=personas.acme.project)
    Replica.objects.create(deployment=mine, node=node, port=18100, state="ready")
    served = Deployment.objects.create(name="tiny-shared", model_path=path, node=node)  # the model itself
    Replica.objects.create(deployment=served, node=node, port=18101, state="ready")

    def what_runs(user):
        [entry] = [e for e in queries.held_entries(user, verdicts=False) if e.pk == shared.pk]
        return {d.name for d in entry.deployments}

    assert what_runs(personas.olivia) == {"acme-copy", "tiny-shared"}
    assert what_runs(personas.oscar) == {"tiny-shared"}  # another tenant's deployment is not theirs to see
    card = queries.held(personas.oscar, [shared])[0]
    assert card.placement["ready"] == 1 and card.placement["nodes"] == ["cpu-held"]
