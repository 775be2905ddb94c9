"""A change of desired state asks for a reconcile pass within a second; a burst asks for one pass."""

import dataclasses
import shutil

import pytest
from django.core.cache import cache

from scheduler.services import register_node
from serving import queues, tasks
from serving.catalog import placing
from serving.catalog.entries import import_local
from serving.models import Deployment, ModelEntry
from serving.node.discovery import local_node_report
from tenancy.audit import Actor

ACTOR = Actor(system="tests")
pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    """What was handed to the broker: (task name, options)."""
    cache.clear()
    handed = []
    monkeypatch.setattr(queues.app, "send_task", lambda name, **options: handed.append((name, options)))
    return handed


def test_a_burst_of_asks_sends_one_pass_and_an_ask_after_it_began_sends_another(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(5):
            queues.reconcile_soon()
    assert sent == [(queues.RECONCILE_SOON, {"queue": queues.CONTROL, "countdown": queues.SOON_S})]
    queues.reconcile_soon_started()  # the pass began reading the fleet: a later change needs its own
    with django_capture_on_commit_callbacks(execute=True):
        queues.reconcile_soon()
    assert len(sent) == 2


def test_nothing_is_asked_before_the_change_commits(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as pending:
        queues.reconcile_soon()
    assert sent == [] and len(pending) == 1


def test_a_broker_outage_loses_the_ask_not_the_change(monkeypatch, django_capture_on_commit_callbacks, caplog):
    cache.clear()

    def refuse(name, **options):
        raise ConnectionError("broker down")

    monkeypatch.setattr(queues.app, "send_task", refuse)
    with django_capture_on_commit_callbacks(execute=True):
        queues.reconcile_soon()
    assert "the periodic one will do" in caplog.text


def test_raising_a_models_minimum_asks_for_a_pass_that_places_it(sent, tmp_path, settings, tiny_model, monkeypatch,
                                                                 django_capture_on_commit_callbacks):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    register_node(dataclasses.replace(local_node_report(), name="soon-node"))
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)
    entry = import_local(ACTOR, shutil.copy(tiny_model, tmp_path / "t.gguf"), name="soon")
    ModelEntry.objects.filter(pk=entry.pk).update(profiles=[{**entry.profiles[0], "context": 256}])
    sent.clear()
    cache.clear()
    with django_capture_on_commit_callbacks(execute=True):
        placing.change(ACTOR, ModelEntry.objects.get(pk=entry.pk), {"scaling_min": 1, "scaling_max": 1})
    assert [name for name, _ in sent] == [queues.RECONCILE_SOON]
    assert not Deployment.objects.filter(name="soon").exists()  # asked for, not yet run
    with django_capture_on_commit_callbacks(execute=True):
        tasks.reconcile_soon()  # what the control worker runs half a second later
    assert Deployment.objects.filter(name="soon").count() == 1
