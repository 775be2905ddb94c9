"""Switch and reconfigure with rollback, on real engines through a real agent."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from scheduler.errors import InsufficientMemory, ModelNotFound
from scheduler.models import Accelerator, MemoryReservation, Node
from scheduler.services import NodeReport, register_node
from serving import queues
from serving.deployments import operations, service, states
from serving.deployments.request import DeployRequest
from serving.models import Deployment, Operation
from serving.node.discovery import local_node_report
from tenancy.audit import Actor
from tenancy.models import AuditEvent
from tests.assets.agent import NODE
from tests.assets.waiting import wait_until

pytestmark = [pytest.mark.llama, pytest.mark.django_db(transaction=True)]
ADMIN = Actor(system="tests")
GIB = 2**30


def assert_untouched(a: Deployment, before) -> None:
    """A still serves from the same engine, and nothing of a switch was recorded."""
    a.refresh_from_db()
    replica = a.replica_set.get()
    assert a.state == "ready" and replica.state == "ready"
    assert (replica.pk, replica.port, replica.handle) == (before.pk, before.port, before.handle)
    assert not Operation.objects.exists()
    assert not AuditEvent.objects.filter(action__in=("deployment.switch", "deployment.reconfigure",
                                                     "deployment.stop")).exists()
    assert list(Deployment.objects.filter(name=a.name).values_list("pk", flat=True)) == [a.pk]


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
    # B's rows are gone (a failed switch leaves only A); why B failed is kept in the undo's step.
    assert list(Deployment.objects.values_list("pk", flat=True)) == [a.pk]
    assert Operation.objects.get(pk=operation.pk).target_id is None
    undo = operation.steps[3]["message"]
    assert "It was failed" in undo and undo.split("Last log lines:\n", 1)[1].strip()


def test_switch_to_a_missing_model_is_refused_and_changes_nothing(agent, model_root, tiny_model):
    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")))
    before = a.replica_set.get()
    request = service.DeployRequest(name="ignored", model_path=str(model_root / "missing.gguf"), node=a.node,
                                    config={"context": 256})
    with pytest.raises(ModelNotFound):  # what service.deploy would answer: 404 model_not_found
        operations.switch(ADMIN, a, request)
    assert_untouched(a, before)


def test_switch_to_a_b_gone_by_the_time_it_runs_restarts_a(agent, model_root, tiny_model):
    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")))
    b = Path(shutil.copy(tiny_model, model_root / "b.gguf"))
    request = service.DeployRequest(name="ignored", model_path=str(b), node=a.node, config={"context": 256})
    recorded = operations.switch(ADMIN, a, request)  # B fits: recorded
    b.unlink()  # and is gone when the control worker carries the switch out
    operation = operations.run(str(recorded.public_id))
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


def test_unfittable_switch_answers_409_with_plans_and_leaves_a_serving(agent, model_root, tiny_model, admin_client):
    a = ready_deployment(Path(shutil.copy(tiny_model, model_root / "a.gguf")))
    before = a.replica_set.get()
    # The node's memory is taken by a lower-priority resident: B fits only if that one stops,
    # even with what A frees counted.
    Deployment.objects.create(name="sitting", model_path="/m.gguf", node=a.node, state="ready", priority=10,
                              memory_reserved_bytes=a.node.memory_total_bytes)
    MemoryReservation.objects.create(node=a.node, holder="replica:sitting", bytes=a.node.memory_total_bytes)
    b = Path(shutil.copy(tiny_model, model_root / "b.gguf"))
    url = f"/api/serving/deployments/{a.public_id}/"
    for verb, body in (("switch", {"model_path": str(b), "config": {"context": 256}}),
                       ("reconfigure", {"config": {"context": 512}})):
        response = admin_client.post(url + f"{verb}/", body, content_type="application/json")
        assert response.status_code == 409, (verb, response.content)
        error = response.json()["error"]
        assert error["code"] == "insufficient_memory"
        fit = error["details"]["fit"]
        assert not fit["fits"] and error["details"]["estimate"]["total_bytes"] > 0
        assert any(action["kind"] == "stop" and action["target"] == "sitting"
                   for plan in fit["plans"] for action in plan["actions"])
    assert_untouched(a, before)
    assert agent.process.poll() is None


def stand_in_agent(operation: str, replica) -> None:
    """What the node agent does with a start or a stop, at once and without an engine: these tests'
    accelerators are rows, not cards, and no engine starts on them."""
    replica.refresh_from_db()
    steps = {"start": ("starting", "loading", "ready"), "stop": ("stopped",)}[operation]  # (stopping: recorded)
    for state in steps:
        states.move(replica, state, "stand-in agent")


def test_reconfigured_gpu_deployment_keeps_its_accelerators_and_counts_what_it_frees(model_root, tiny_model,
                                                                                    monkeypatch):
    monkeypatch.setattr(queues, "to_node", stand_in_agent)
    monkeypatch.setattr(queues, "to_control", lambda *args: None)
    node = register_node(NodeReport(name="gpu-stand-in", address="127.0.0.1", cpu_count=8,
                                    memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB))
    cards = [Accelerator.objects.create(node=node, index=i, uuid=f"GPU-stand-in-{i}", name="NVIDIA H100 80GB HBM3",
                                        accelerator_class="H100-80GB", memory_total_bytes=80 * GIB,
                                        memory_used_bytes=0) for i in range(2)]
    model = Path(shutil.copy(tiny_model, model_root / "a.gguf"))
    a = service.deploy(ADMIN, DeployRequest(name="chat", model_path=str(model), node=node, config={"context": 256},
                                            accelerator=cards[0], shards=(cards[1],)))
    a.refresh_from_db()
    assert a.state == "ready" and a.gpu_uuids == [c.uuid for c in cards]
    a_holder = states.holder_of(a.replica_set.get())
    assert MemoryReservation.objects.filter(holder__startswith=a_holder).count() == 2

    # The second card is nearly full: B (the same model, a larger context) fits there only in A's place.
    wanted = service.preview(ADMIN, DeployRequest.of(a, config={**a.config, "context": 512})).estimate.total_bytes
    free = service.memory.budget_for(node, cards[1]).free_for_new
    hog = MemoryReservation.objects.create(node=node, accelerator=cards[1], holder="elsewhere",
                                           bytes=free - wanted + a.memory_reserved_bytes // 2)
    assert service.memory.budget_for(node, cards[1]).free_for_new < wanted  # a fresh deploy would not fit
    assert not Operation.objects.exists()

    # Taken a little further, not even A's place is enough: refused, nothing recorded.
    MemoryReservation.objects.filter(pk=hog.pk).update(bytes=hog.bytes + a.memory_reserved_bytes)
    with pytest.raises(InsufficientMemory) as refused:
        operations.reconfigure(ADMIN, a, {"context": 512})
    assert not refused.value.details["fit"]["fits"] and "plans" in refused.value.details["fit"]
    assert not Operation.objects.exists() and Deployment.objects.get(pk=a.pk).state == "ready"
    MemoryReservation.objects.filter(pk=hog.pk).update(bytes=hog.bytes)

    recorded = operations.reconfigure(ADMIN, a, {"context": 512})
    assert recorded.request["accelerators"] == a.gpu_uuids
    operation = operations.run(str(recorded.public_id))
    assert operation.state == Operation.State.SUCCEEDED, operation.steps
    b = Deployment.objects.get(pk=operation.target_id)
    assert b.gpu_uuids == a.gpu_uuids and b.config["context"] == 512 and b.state == "ready"
    b_holder = states.holder_of(b.replica_set.get())
    assert {r.accelerator_id for r in MemoryReservation.objects.filter(holder__startswith=b_holder)} == \
        {c.pk for c in cards}
    assert not MemoryReservation.objects.filter(holder__startswith=a_holder).exists()  # A stopped, gave it back


class FakeClock:
    """``time`` for ``operations``: each poll's pause moves the clock on and lets ``script`` act."""

    def __init__(self, script):
        self.now, self.script = 0.0, script

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += 10
        self.script(self.now)


def test_time_queued_at_the_start_up_gate_does_not_count_against_the_deadline(model_root, tiny_model, monkeypatch,
                                                                             settings):
    settings.SERVING_STARTUP_TIMEOUT_SECONDS, settings.SERVING_QUEUE_TIMEOUT_SECONDS = 300, 1800
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: None)  # the script plays the agent
    node = register_node(dataclasses.replace(local_node_report(), name=NODE))
    model = Path(shutil.copy(tiny_model, model_root / "b.gguf"))

    def queued_deployment(name):
        deployment = service.deploy(ADMIN, DeployRequest(name=name, model_path=str(model), node=node,
                                                         config={"context": 256}))
        states.move(deployment.replica_set.get(), "queued", "waiting for a start-up slot")
        return deployment

    def comes_up(deployment, leaves_queue_at, ready_at):
        def script(now):
            replica = deployment.replica_set.get()
            if now >= leaves_queue_at and replica.state == "queued":
                states.move(replica, "starting", "start-up slot taken")
            if now >= ready_at and replica.state == "starting":
                states.move(replica, "ready", "up")
        return script

    # Queued 1000 s (longer than the 360 s start-up deadline), then up 200 s after leaving the queue.
    b = queued_deployment("b")
    monkeypatch.setattr(operations, "time", FakeClock(comes_up(b, 1000, 1200)))
    operations._wait_ready(b)
    assert b.state == "ready"

    # The deadline still holds once it has left the queue ...
    c = queued_deployment("c")
    monkeypatch.setattr(operations, "time", FakeClock(comes_up(c, 100, 10**6)))
    with pytest.raises(operations._Timeout, match="still starting after 360s"):
        operations._wait_ready(c)

    # ... and the queue itself is bounded (a queued replica also fails on its own after the queue timeout).
    d = queued_deployment("d")
    monkeypatch.setattr(operations, "time", FakeClock(comes_up(d, 10**6, 10**6)))
    with pytest.raises(operations._Timeout, match="still queued after 1860s"):
        operations._wait_ready(d)
