"""On-demand models: the first request's load (through a real agent and engine) and the idle unload."""

import shutil
import time

import pytest
from django.core.cache import cache

from serving import ondemand
from serving.catalog.entries import import_local
from serving.catalog.models import ModelEntry
from serving.deployments import placement
from serving.models import Deployment
from serving.routing import ModelNotLoadable, request_load
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
    ondemand.note_used({"lazy": time.time() - 30})
    assert placement.reconcile()["evicted"] == []  # 30 s of a 60 s timeout
    ondemand.note_used({"lazy": time.time() - 61})
    assert placement.reconcile()["evicted"] == ["lazy"]
    wait_until(lambda: Deployment.objects.filter(pk=deployment.pk, state="stopped").exists(), 60, what="unloaded")

    request_load("lazy")  # the next request starts the same deployment again
    wait_until(lambda: Deployment.objects.filter(pk=deployment.pk, state="ready").exists(), 120, what="ready again")
    assert Deployment.objects.count() == 1


def test_a_model_that_is_not_on_demand_is_refused_at_once(db, tiny_model, tmp_path, model_root):
    entry = on_demand_entry(tiny_model, tmp_path, name="always")
    ModelEntry.objects.filter(pk=entry.pk).update(scaling_min=1)
    with pytest.raises(ModelNotLoadable, match="not an on-demand model"):
        request_load("always")
    with pytest.raises(ModelNotLoadable):
        request_load("nothing-of-that-name")


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
