"""Serving applies Scheduler II's plans for the catalog's models: launches to meet the scaling
minimum, surplus evicted, a fixed point once converged, and what the catalog does not know untouched."""

import dataclasses
import shutil

import pytest

from scheduler.models import PlacementDecision
from scheduler.services import register_node
from serving.catalog.entries import import_local
from serving.catalog.models import ModelEntry
from serving.deployments import placement, service
from serving.discovery import local_node_report
from serving.models import Deployment, Replica
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db
ACTOR = Actor(system="tests")


@pytest.fixture
def setup(tmp_path, settings, tiny_model, monkeypatch):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    node = register_node(dataclasses.replace(local_node_report(), name="place-node"))
    sent = []
    monkeypatch.setattr(service, "dispatch", lambda operation, replica: sent.append((operation, replica.deployment.name)))
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "t.gguf"), name="placed")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1, scaling_max=1,
                                                  profiles=[{**entry.profiles[0], "context": 256}])
    return node, sent


def serving_count(name="placed") -> int:
    return Replica.objects.filter(deployment__name=name).exclude(state__in=("stopped", "failed")).count()


def test_the_minimum_is_launched_once_and_recorded_as_evidence(setup, django_capture_on_commit_callbacks):
    node, sent = setup
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["launched"] == ["placed"]
    deployment = Deployment.objects.get(name="placed")
    assert deployment.node == node and sent == [("start", "placed")]
    assert PlacementDecision.objects.filter(model="placed").exists()
    assert placement.reconcile() == {"launched": [], "evicted": []}  # converged: a fixed point
    assert serving_count() == 1


def test_a_higher_minimum_adds_a_replica_and_a_lower_maximum_evicts_the_surplus(
        setup, django_capture_on_commit_callbacks):
    _, sent = setup
    placement.reconcile()
    ModelEntry.objects.filter(name="placed").update(scaling_min=2, scaling_max=2)
    assert placement.reconcile()["launched"] == ["placed"]
    assert serving_count() == 2
    Replica.objects.filter(deployment__name="placed").update(state="ready")
    Deployment.objects.filter(name="placed").update(state="ready")
    ModelEntry.objects.filter(name="placed").update(scaling_min=1, scaling_max=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.reconcile()["evicted"] == ["placed"]
    assert sent.count(("stop", "placed")) == 1  # one of the two is asked to stop; its agent stops it


def test_deployments_the_catalog_does_not_know_are_left_alone(setup, tiny_model, tmp_path):
    node, _ = setup
    manual = service.deploy(ACTOR, service.DeployRequest(
        name="by-hand", model_path=str(shutil.copy(tiny_model, tmp_path / "models" / "m.gguf")), node=node,
        config={"context": 256}))
    placement.reconcile()
    placement.reconcile()
    manual.refresh_from_db()
    assert manual.state == "planned" and serving_count("by-hand") == 1
