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
from tests.assets.agent import NODE
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]
ADMIN = Actor(system="tests")






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


def test_deploy_after_stopping_another_and_its_undo(agent, model_root, tiny_model, gguf_model):
    from scheduler.models import MemoryReservation

    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")), name="resident")
    stop_a = [{"kind": "stop", "target": "resident"}]
    missing = service.DeployRequest(name="newcomer", model_path=str(model_root / "missing.gguf"), node=a.node,
                                    config={"context": 256})
    # The deploy is refused after the stop: the stop is undone, A serves again.
    operation = operations.run(str(operations.deploy_after(ADMIN, missing, stop_a).public_id))
    assert operation.state == Operation.State.ROLLED_BACK, operation.steps
    assert [(s["step"], s["status"]) for s in operation.steps] == [
        ("stop resident", "done"), ("deploy", "failed"), ("undo: start resident", "done")]
    a.refresh_from_db()
    assert a.state == "ready" and not Deployment.objects.filter(name="newcomer").exists()

    # When even the undo cannot happen (the memory went elsewhere meanwhile), the operation says which step.
    request = service.DeployRequest(name="newcomer", model_path=str(Path(shutil.copy(
        gguf_model("b.gguf", layers=3), model_root / "b.gguf"))), node=a.node, config={"context": 256})
    hog = MemoryReservation.objects.create(node=a.node, holder="elsewhere", bytes=a.node.memory_total_bytes)
    operation = operations.run(str(operations.deploy_after(ADMIN, request, stop_a).public_id))
    assert operation.state == Operation.State.ROLLBACK_INCOMPLETE
    assert "start resident" in operation.message
    hog.delete()

    # With the memory back, the same choice deploys.
    service.start(ADMIN, Deployment.objects.get(pk=a.pk))
    wait_until(lambda: Deployment.objects.filter(pk=a.pk, state="ready").exists(), 120, what="A ready again")
    operation = operations.run(str(operations.deploy_after(ADMIN, request, stop_a).public_id))
    assert operation.state == Operation.State.SUCCEEDED, operation.steps
    a.refresh_from_db()
    assert a.state == "stopped"
    newcomer = Deployment.objects.get(name="newcomer")
    wait_until(lambda: Deployment.objects.filter(pk=newcomer.pk, state="ready").exists(), 120, what="B ready")


def test_preview_offers_to_stop_what_runs_when_it_does_not_fit(db, model_root, tiny_model):
    from scheduler.services import NodeReport

    node = register_node(NodeReport(name="snug", address="127.0.0.1", cpu_count=2, memory_total_bytes=9 * 2**30,
                                    memory_available_bytes=int(8.95 * 2**30)))
    from scheduler.models import MemoryReservation

    Deployment.objects.create(name="sitting", model_path="/m.gguf", node=node, state="ready", priority=10,
                              memory_reserved_bytes=2**30)
    MemoryReservation.objects.create(node=node, holder="replica:sitting", bytes=int(0.99 * 2**30))
    result = service.preview(Actor(system="tests"), service.DeployRequest(name="new", model_path=str(Path(shutil.copy(
        tiny_model, model_root / "n.gguf"))), node=node, config={"context": 256}, priority=50))
    assert not result.fit.fits
    actions = [a for plan in result.fit.plans for a in plan.actions]
    assert any(a.kind == "stop" and a.target == "sitting" for a in actions)
