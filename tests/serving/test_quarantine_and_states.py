"""A quarantined file is never deployable, and the replica state machine is dgxmm's."""

from __future__ import annotations

import shutil

import pytest

from scheduler import memory
from scheduler.errors import ModelQuarantined
from scheduler.services import NodeReport, register_node
from serving import queues
from serving.deployments import service, states
from serving.models import Deployment, DeploymentState as S, Replica
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db
ADMIN = Actor(system="tests")


@pytest.fixture
def node():
    return register_node(NodeReport(name="cpu-q", address="127.0.0.1", cpu_count=8,
                                    memory_total_bytes=64 * 2**30, memory_available_bytes=60 * 2**30))


@pytest.fixture
def quarantined(tmp_path, settings, tiny_model):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    quarantine = memory.quarantine_root() / "org" / "repo" / "abc123"
    quarantine.mkdir(parents=True)
    return shutil.copy(tiny_model, quarantine / "tiny.gguf")


def test_a_file_in_the_quarantine_is_refused_by_path_with_its_own_code(node, quarantined, monkeypatch):
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)
    request = service.DeployRequest(name="q", model_path=str(quarantined), node=node, config={"context": 256})
    with pytest.raises(ModelQuarantined) as refused:
        service.deploy(ADMIN, request)
    assert refused.value.code == "model_quarantined" and refused.value.status == 400
    with pytest.raises(ModelQuarantined):
        service.preview(ADMIN, request)
    assert not Deployment.objects.exists()


def test_the_api_refuses_a_quarantined_path_for_a_deploy_and_an_estimate(client, admin_user, node, quarantined):
    client.force_login(admin_user)
    deploy = client.post("/api/serving/deployments/", {"name": "q", "model_path": str(quarantined), "node": node.name,
                                                        "config": {"context": 256}}, content_type="application/json")
    assert deploy.status_code == 400 and deploy.json()["error"]["code"] == "model_quarantined"
    estimate = client.post("/api/scheduler/estimate/", {"model_path": str(quarantined), "engine": "llamacpp"},
                           content_type="application/json")
    assert estimate.status_code == 400 and estimate.json()["error"]["code"] == "model_quarantined"
    assert not Deployment.objects.exists()


def test_a_file_beside_the_quarantine_is_still_allowed(tmp_path, settings, tiny_model):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    beside = root / ".quarantine-not" / "tiny.gguf"
    beside.parent.mkdir()
    shutil.copy(tiny_model, beside)
    assert memory.allowed_model_path(beside) == beside.resolve()


@pytest.fixture
def replica(node, tmp_path):
    deployment = Deployment.objects.create(name="m", model_path=str(tmp_path / "m.gguf"), node=node)
    return Replica.objects.create(deployment=deployment, node=node, port=18001, state=S.PLANNED)


def at(replica, state):
    Replica.objects.filter(pk=replica.pk).update(state=state)
    replica.refresh_from_db()
    return replica


@pytest.mark.parametrize("origin, to", [
    (S.STARTING, S.READY),  # an engine up before its load was watched
    (S.STOPPED, S.FAILED),  # a failure found after it stopped: the reason is kept
    (S.FAILED, S.FAILED),  # failed again: the later reason replaces the first
    (S.QUEUED, S.STOPPED), (S.LOADING, S.STOPPING), (S.SLEEPING, S.READY), (S.UNKNOWN, S.STOPPING),
])
def test_the_transitions_of_the_reference_machine_are_allowed(replica, origin, to):
    assert states.move(at(replica, origin), to, "test")
    replica.refresh_from_db()
    assert replica.state == to
    assert replica.deployment.events.filter(from_state=origin, to_state=to).exists()


@pytest.mark.parametrize("origin, to", [
    (S.STARTING, S.STOPPED),  # a stop while the engine launches goes through stopping
    (S.STOPPED, S.STARTING), (S.STOPPED, S.QUEUED),  # a start makes a fresh replica
    (S.READY, S.READY), (S.PLANNED, S.READY), (S.LOADING, S.SLEEPING),
])
def test_what_the_machine_does_not_have_is_refused_and_changes_nothing(replica, origin, to):
    with pytest.raises(states.IllegalTransition):
        states.move(at(replica, origin), to, "test")
    replica.refresh_from_db()
    assert replica.state == origin and not replica.deployment.events.exists()


def test_a_replica_that_ends_gives_back_what_it_held(node, replica):
    holder = states.holder_of(replica)
    memory.reserve_shards(node, holder, 2**30, [], description="m")
    assert memory.MemoryReservation.objects.filter(holder=holder).exists()
    assert states.move(replica, S.STOPPED, "cancelled before it started")
    assert not memory.MemoryReservation.objects.filter(holder=holder).exists()
