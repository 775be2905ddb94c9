"""On-demand models: the first request's load (through a real agent and engine) and the idle unload."""

import shutil
import time

import pytest
from django.core.cache import cache

from serving import load
from serving.control import ondemand
from serving.catalog.entries import import_local
from serving.models import ModelEntry
from serving.control import placement
from serving.models import Deployment
from serving.control.ondemand import NotLoadable as ModelNotLoadable, request_load
from tenancy.audit import Actor
from tests.assets.agent import NODE
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]






@pytest.fixture(autouse=True)
def no_remembered_use():
    cache.clear()  # last uses of earlier tests' models must not count here


def on_demand_entry(tiny_model, tmp_path, name="lazy", idle=60):
    source = shutil.copy(tiny_model, tmp_path / "source.gguf")
    entry = import_local(Actor(system="tests"), source, name=name)
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=0, idle_timeout_seconds=idle,
                                                  profiles=[{**entry.profiles[0], "context": 256}])
    return ModelEntry.objects.get(pk=entry.pk)


def test_first_request_loads_the_model_and_idle_time_unloads_it(agent, tiny_model, tmp_path):
    entry = on_demand_entry(tiny_model, tmp_path)
    assert not Deployment.objects.exists()
    ticket = request_load("lazy")
    assert ticket.expected_seconds > 0
    request_load("lazy")  # many waiting requests ask: still one deployment
    deployment = Deployment.objects.get()
    assert deployment.node.name == NODE and deployment.name == entry.name
    wait_until(lambda: Deployment.objects.filter(pk=deployment.pk, state="ready").exists(), 120, what="ready")

    # The placement policy unloads it once idle past its timeout.
    assert placement.reconcile()["evicted"] == []  # its last use is not known yet: not idle, the clock starts now
    load.note_used({"lazy": time.time() - 30})
    assert placement.reconcile()["evicted"] == []  # 30 s of a 60 s timeout
    load.note_used({"lazy": time.time() - 61})
    assert placement.reconcile()["evicted"] == ["lazy"]
    wait_until(lambda: Deployment.objects.filter(pk=deployment.pk, state="stopped").exists(), 60, what="unloaded")

    request_load("lazy")  # the next request starts the same deployment again
    wait_until(lambda: Deployment.objects.filter(pk=deployment.pk, state="ready").exists(), 120, what="ready again")
    assert Deployment.objects.count() == 1


def test_an_always_on_model_never_placed_is_refused_at_once_with_the_policys_reason(db, tiny_model, tmp_path,
                                                                                     model_root, monkeypatch):
    entry = on_demand_entry(tiny_model, tmp_path, name="always")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1)
    monkeypatch.setattr(placement, "reconcile", lambda **_: pytest.fail("a request placed an always-on model"))
    with pytest.raises(ModelNotLoadable, match="always on") as refused:
        request_load("always")  # no pass has decided anything yet
    assert refused.value.details["reason"].startswith("not placed yet") and refused.value.details["model"] == "always"
    monkeypatch.undo()
    assert placement.reconcile()["unschedulable"]["always"]  # no node at all: the policy says why, as evidence
    with pytest.raises(ModelNotLoadable, match="always on") as refused:
        request_load("always")
    said = refused.value.details["policy"]
    assert said and said in refused.value.message and refused.value.details["reason"] == f"the placement policy: {said}"
    assert not Deployment.objects.exists()
    with pytest.raises(ModelNotLoadable, match="not in the catalog") as refused:
        request_load("nothing-of-that-name")
    assert refused.value.details["reason"] == "not in the catalog"


def test_a_parked_model_is_refused_at_once_naming_its_park_reason_and_last_error(db, tiny_model, tmp_path,
                                                                                model_root, monkeypatch):
    from scheduler import recovery_service

    entry = on_demand_entry(tiny_model, tmp_path, name="given-up")
    for minimum in (1, 0):  # always on, or on demand: a parked model is not placed by a request either
        ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=minimum)
        for _ in range(5):
            recovery_service.note_failure("given-up", "crash", "engine exited with status 1 while loading",
                                          entry.fingerprint)
        monkeypatch.setattr(placement, "reconcile", lambda **_: pytest.fail("asked the policy about a parked model"))
        with pytest.raises(ModelNotLoadable, match="parked after 5 failure") as refused:
            request_load("given-up")
        details = refused.value.details
        assert details["parked"] is True and details["failure"] == "crash" and details["consecutive"] == 5
        assert details["last_error"] == "engine exited with status 1 while loading"
        assert "engine exited with status 1 while loading" in refused.value.message
        assert "parked after 5 failure(s)" in details["reason"]
        monkeypatch.undo()
        recovery_service.retry(Actor(system="tests"), "given-up")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1)
    for _ in range(5):
        recovery_service.note_failure("given-up", "crash", "boom", "an-older-definition")
    with pytest.raises(ModelNotLoadable, match="always on"):  # parked under another definition: not parked now
        request_load("given-up")


def test_an_on_demand_model_that_fits_nowhere_says_why(db, tiny_model, tmp_path, model_root, monkeypatch):
    from scheduler.services import NodeReport, register_node

    register_node(NodeReport(name="small", address="127.0.0.1", cpu_count=1, memory_total_bytes=2**30,
                             memory_available_bytes=2**29))
    on_demand_entry(tiny_model, tmp_path)
    with pytest.raises(ModelNotLoadable, match="fits on no node now") as refused:
        request_load("lazy")
    assert "small" in refused.value.message
    assert "the placement policy: fits nowhere" in refused.value.message  # it asked the policy too
    monkeypatch.setattr(placement, "reconcile", lambda **_: pytest.fail("asked the policy again at once"))
    with pytest.raises(ModelNotLoadable, match="the placement policy: fits nowhere"):
        request_load("lazy")  # a burst of requests gets the policy's last answer
    assert not Deployment.objects.exists()
