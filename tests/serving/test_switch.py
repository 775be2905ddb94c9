"""Switch and reconfigure with rollback, on real engines through a real agent."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from scheduler.models import Node
from scheduler.services import register_node
from serving.deployments import operations, service
from serving.discovery import local_node_report
from serving.models import Deployment, Operation
from tenancy.audit import Actor
from tests.assets.agent import NODE, Agent
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]
ADMIN = Actor(system="tests")


@pytest.fixture
def model_root(tmp_path, settings):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    settings.SERVING_MODEL_ROOTS = [root.resolve()]
    return root


@pytest.fixture
def agent(tmp_path, model_root):
    register_node(dataclasses.replace(local_node_report(), name=NODE))
    running = Agent(tmp_path, model_root)
    yield running
    for deployment in Deployment.objects.exclude(state__in=("stopped", "failed")):
        service.stop(ADMIN, deployment)
    try:
        wait_until(lambda: not Deployment.objects.exclude(state__in=("stopped", "failed")).exists(), 60,
                   what="every deployment stopped")
    finally:
        running.stop()


def ready_deployment(model: Path, name: str = "chat") -> Deployment:
    deployment = service.deploy(ADMIN, service.DeployRequest(name=name, model_path=str(model),
                                                             node=Node.objects.get(name=NODE),
                                                             config={"context": 256}))
    wait_until(lambda: Deployment.objects.filter(pk=deployment.pk, state="ready").exists(), 120, what="A ready")
    deployment.refresh_from_db()
    return deployment


def test_switch_to_a_failing_b_rolls_back_to_a(agent, model_root, tiny_model):
    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")))
    broken = model_root / "b.gguf"
    data = tiny_model.read_bytes()
    broken.write_bytes(data[: len(data) // 3])  # a readable header, truncated weights: fails while loading
    request = service.DeployRequest(name="ignored", model_path=str(broken), node=a.node, config={"context": 256})
    operation = operations.switch(ADMIN, a, request)
    operation = operations.run(str(operation.public_id))  # what the control worker's task does
    assert operation.state == Operation.State.ROLLED_BACK, operation.steps
    assert [s["step"] for s in operation.steps] == ["stop A", "deploy B", "B ready", "undo: stop B", "undo: start A"]
    assert [s["status"] for s in operation.steps] == ["done", "done", "failed", "done", "done"]
    a.refresh_from_db()
    assert a.state == "ready"
    b = Deployment.objects.get(pk=operation.target_id)
    assert b.name == a.name and b.state == "failed"
    assert b.events.get(to_state="failed").log_tail  # why B failed is kept


def test_switch_to_a_b_that_cannot_be_placed_restarts_a(agent, model_root, tiny_model):
    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")))
    request = service.DeployRequest(name="ignored", model_path=str(model_root / "missing.gguf"), node=a.node,
                                    config={"context": 256})
    operation = operations.run(str(operations.switch(ADMIN, a, request).public_id))
    assert operation.state == Operation.State.ROLLED_BACK
    assert [(s["step"], s["status"]) for s in operation.steps] == [
        ("stop A", "done"), ("deploy B", "failed"), ("undo: start A", "done")]
    assert operation.target_id is None
    a.refresh_from_db()
    assert a.state == "ready"


def test_reconfigure_replaces_the_deployment_under_the_same_name(agent, model_root, tiny_model):
    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")))
    operation = operations.run(str(operations.reconfigure(ADMIN, a, {"context": 512}).public_id))
    assert operation.state == Operation.State.SUCCEEDED, operation.steps
    b = Deployment.objects.get(pk=operation.target_id)
    assert b.name == a.name and b.state == "ready" and b.config["context"] == 512
    a.refresh_from_db()
    assert a.state == "stopped"


def test_only_a_serving_deployment_is_switched(db, model_root, tiny_model):
    node = register_node(dataclasses.replace(local_node_report(), name=NODE))
    a = Deployment.objects.create(name="idle", model_path="/x.gguf", node=node, state="stopped")
    from serving.errors import DeploymentConflict

    with pytest.raises(DeploymentConflict, match="only a serving deployment"):
        operations.switch(ADMIN, a, service.DeployRequest(name="idle", model_path="/y.gguf", node=node))
    assert not Operation.objects.exists()
