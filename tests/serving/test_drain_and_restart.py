"""Drains that drain and rolling restarts, through the control loop on the database: a draining
node's replica is replaced on another node and stops once the new one is ready; a rolling restart
(API, console, ``manage.py restart_model``) replaces a model's replicas one at a time. The node's page
and API say what is moving and what cannot be moved, to staff only; the restart takes member on the
model's owner, as a change of its placement does."""

from __future__ import annotations

import dataclasses
import io
import shutil
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from rest_framework.test import APIClient

from scheduler import services as fleet
from scheduler.services import register_node
from serving import queues
from serving.catalog import restarts
from serving.catalog.entries import import_local
from serving.control import placement
from serving.deployments import states
from serving.models import Deployment, ModelEntry, Replica
from serving.node.discovery import local_node_report
from tenancy.audit import Actor
from tenancy.models import AuditEvent
from tenancy.services import clients

pytestmark = pytest.mark.django_db
ADMIN = Actor(system="tests")
GONE = ("stopped", "failed", "stopping")


@pytest.fixture(autouse=True)
def nothing_remembered():
    cache.clear()  # holds, moves and scaling states of earlier tests must not count here


@pytest.fixture
def fleet_of_two(tmp_path, settings, tiny_model, monkeypatch, personas):
    """Two CPU nodes; a model of acme/ml/search wanting one replica; the agents' queue recorded."""
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    nodes = [register_node(dataclasses.replace(local_node_report(), name=name)) for name in ("node-a", "node-b")]
    sent = []
    monkeypatch.setattr(queues, "to_node",
                        lambda operation, replica: sent.append((operation, replica.node.name, replica.pk)))
    entry = import_local(ADMIN, shutil.copy(tiny_model, tmp_path / "t.gguf"), name="moved",
                         owner=personas.acme.project)
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1,
                                                  profiles=[{**entry.profiles[0], "context": 256}])
    return nodes, sent


def live(name="moved"):
    return list(Replica.objects.filter(deployment__name=name).exclude(state__in=GONE).select_related("node")
                .order_by("created_at"))


def come_up(ago=600):
    """Every replica of the model starting is ready (as its agent would record)."""
    now = timezone.now()
    Replica.objects.filter(deployment__name="moved").exclude(state__in=GONE).update(
        state="ready", started_at=now - timedelta(seconds=ago + 10), ready_at=now - timedelta(seconds=ago))
    Deployment.objects.filter(name="moved").exclude(state__in=GONE).update(state="ready")


def stopped_by_agents(sent):
    """The agents did what they were sent: every replica asked to stop has stopped."""
    for replica in Replica.objects.filter(deployment__name="moved", state="stopping"):  # (recorded when asked)
        if ("stop", replica.node.name, replica.pk) in sent:
            states.move(replica, "stopped", "stopped by its agent")  # which gives its reservation back


def api(user=None, key=None) -> APIClient:
    client = APIClient()
    if key:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    elif user is not None:
        client.force_login(user)
    return client


def test_a_drained_nodes_replica_is_replaced_on_another_node_before_it_stops(fleet_of_two, admin_user, personas,
                                                                           django_capture_on_commit_callbacks):
    (a, b), sent = fleet_of_two
    placement.reconcile()
    [first] = live()
    come_up()
    drained_node = first.node
    other = b if drained_node == a else a
    fleet.drain(drained_node, ADMIN, reason="kernel upgrade")

    assert placement.reconcile()["launched"] == ["moved"]
    old, new = live()
    assert (old.pk, old.state, new.node) == (first.pk, "ready", other)  # the old one serves meanwhile
    moves = api(admin_user).get(f"/api/scheduler/nodes/{drained_node.public_id}/moves/").json()
    assert moves["state"] == "draining"
    assert [(m["model"], m["state"], m["why"]) for m in moves["moves"]] == [("moved", "waiting", "drain")]
    client = api(admin_user)
    page = client.get(f"/fleet/nodes/{drained_node.public_id}/").content.decode()
    assert "Moving off this node" in page and "waits for its replacement to be ready" in page

    assert placement.reconcile()["evicted"] == []  # not ready yet: nothing stops
    come_up()
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["evicted"] == ["moved"]
    assert ("stop", drained_node.name, first.pk) in sent and ("stop", other.name, new.pk) not in sent
    stopped_by_agents(sent)
    [left] = live()
    assert left.pk == new.pk
    placement.reconcile()
    moves = api(admin_user).get(f"/api/scheduler/nodes/{drained_node.public_id}/moves/").json()
    assert moves["moves"] == []
    page = client.get(f"/fleet/nodes/{drained_node.public_id}/").content.decode()
    assert "Nothing left to move" in page


def test_what_is_moving_is_for_staff_only(fleet_of_two, personas):
    (a, _), _ = fleet_of_two
    fleet.drain(a, ADMIN)
    placement.reconcile()
    for user in (personas.olivia, personas.oscar, personas.vera):
        response = api(user).get(f"/api/scheduler/nodes/{a.public_id}/moves/")
        assert response.status_code == 403, user
        page = api(user).get(f"/fleet/nodes/{a.public_id}/").content.decode()
        assert "Moving off this node" not in page and "moved" not in page


def test_a_node_that_cannot_be_emptied_says_why_on_its_page(fleet_of_two, admin_user):
    (a, b), _ = fleet_of_two
    placement.reconcile()
    [first] = live()
    come_up()
    fleet.cordon(b if first.node == a else a, ADMIN)  # the only other node takes no new work
    fleet.drain(first.node, ADMIN)
    placement.reconcile()
    [still] = live()
    assert still.pk == first.pk and still.state == "ready"  # nothing is stopped that cannot be replaced
    [move] = api(admin_user).get(f"/api/scheduler/nodes/{first.node.public_id}/moves/").json()["moves"]
    assert move["state"] == "blocked" and move["detail"].startswith("cannot be moved: ")
    assert "cordoned" in move["detail"] or "draining" in move["detail"]


def test_a_rolling_restart_through_the_api_replaces_the_replica_and_is_audited(fleet_of_two, personas,
                                                                              django_capture_on_commit_callbacks):
    (a, b), sent = fleet_of_two
    entry = ModelEntry.objects.get(name="moved")
    url = f"/api/serving/catalog/models/{entry.public_id}/restart/"
    refused = api(personas.max).post(url)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "nothing_to_restart"
    placement.reconcile()
    [first] = live()
    come_up()

    assert api(personas.vera).post(url).status_code == 403  # a viewer reads, does not restart
    assert api(personas.oscar).post(url).status_code == 404  # another organisation does not see it
    asked = api(personas.max).post(url)
    assert asked.status_code == 202 and asked.json()["restart"]["replicas_left"] == 1
    event = AuditEvent.objects.get(action="catalog.model.restart")
    assert event.details == {"name": "moved", "replicas": 1} and event.scope == personas.acme.project

    assert placement.reconcile()["launched"] == ["moved"]
    assert [r.pk for r in live()][0] == first.pk and len(live()) == 2
    where = api(personas.vera).get(url).json()["restart"]  # a viewer follows it
    assert (where["state"], where["replicas_left"]) == ("waiting", 1)
    come_up()
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["evicted"] == ["moved"]
    stopped_by_agents(sent)
    [fresh] = live()
    assert fresh.pk != first.pk
    assert api(personas.max).get(url).json()["restart"] is None  # done


def test_a_management_key_restarts_its_own_projects_model_and_not_another_organisations(fleet_of_two, personas):
    placement.reconcile()
    come_up()
    entry = ModelEntry.objects.get(name="moved")
    url = f"/api/serving/catalog/models/{entry.public_id}/restart/"
    own = clients.create_client(personas.olivia_actor, personas.acme.project, "robot", access="management")
    _, own_key = clients.create_credential(personas.olivia_actor, own, name="ci")
    theirs = clients.create_client(personas.oscar_actor, personas.globex.project, "robot", access="management")
    _, their_key = clients.create_credential(personas.oscar_actor, theirs, name="ci")
    assert api(key=their_key).post(url).status_code == 404
    assert api(key=own_key).post(url).status_code == 202


def test_the_card_restarts_a_model_and_shows_where_it_stands(fleet_of_two, personas, client):
    placement.reconcile()
    come_up()
    entry = ModelEntry.objects.get(name="moved")
    client.force_login(personas.vera)
    assert "Rolling restart</button>" not in client.get(f"/models/held/{entry.public_id}/").content.decode()
    assert client.post(f"/models/held/{entry.public_id}/restart/").status_code == 403
    client.force_login(personas.max)
    card = client.get(f"/models/held/{entry.public_id}/").content.decode()
    assert "Rolling restart</button>" in card
    done = client.post(f"/models/held/{entry.public_id}/restart/", follow=True).content.decode()
    assert "a rolling restart is under way" in done and 'class="restart" data-state="waiting"' in done
    placement.reconcile()
    card = client.get(f"/models/held/{entry.public_id}/").content.decode()
    assert "1 replica still to replace" in card and "waits for its replacement to be ready" in card


def test_manage_py_restart_model(fleet_of_two):
    with pytest.raises(CommandError, match="no catalog model is named 'nope'"):
        call_command("restart_model", "nope", stdout=io.StringIO())
    with pytest.raises(CommandError, match="nothing_to_restart"):
        call_command("restart_model", "moved", stdout=io.StringIO())
    placement.reconcile()
    come_up()
    out = io.StringIO()
    call_command("restart_model", "moved", stdout=out)
    assert "a rolling restart is under way" in out.getvalue()
    assert restarts.progress(ModelEntry.objects.get(name="moved"))["replicas_left"] == 1
