"""The Models area and the deployments API: who sees what, the wizard's preview, refusals."""

from __future__ import annotations

import shutil

import pytest

from scheduler.services import NodeReport, register_node
from serving.deployments import service
from serving.models import Deployment, Replica
from tenancy.audit import Actor

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    return register_node(NodeReport(name="cpu-01", address="127.0.0.1", cpu_count=8,
                                    memory_total_bytes=64 * 2**30, memory_available_bytes=60 * 2**30))


@pytest.fixture
def model(tmp_path, settings, tiny_model):
    root = tmp_path / "models"
    root.mkdir()
    settings.SCHEDULER_MODEL_ROOTS = [root.resolve()]
    return shutil.copy(tiny_model, root / "tiny.gguf")


@pytest.fixture
def no_agent(monkeypatch):
    """Nothing consumes the node's queue in these tests: record what would be dispatched."""
    sent = []
    monkeypatch.setattr(service, "dispatch", lambda operation, replica: sent.append((operation, replica.public_id)))
    return sent


def form(model, node, **overrides):
    data = {"name": "tiny", "model_path": str(model), "node": node.name, "task": "chat", "engine": "llamacpp",
            "runtime": "process", "owner": "project:acme/ml/search", "priority": 50, "context": 256, "parallel": 1}
    data.update(overrides)
    return data


def test_preview_shows_the_breakdown_and_changes_nothing(client, personas, node, model):
    client.force_login(personas.max)
    response = client.post("/models/deploy/preview/", form(model, node), HTTP_HX_REQUEST="true")
    body = response.content.decode()
    assert response.status_code == 200 and "Memory check" in body and "Fits:" in body
    assert "<html" not in body
    assert not Deployment.objects.exists() and not Replica.objects.exists()


def test_preview_of_a_file_outside_the_model_roots_says_so(client, personas, node, tmp_path):
    client.force_login(personas.max)
    response = client.post("/models/deploy/preview/", form(tmp_path / "elsewhere.gguf", node), HTTP_HX_REQUEST="true")
    assert "outside the model directories" in response.content.decode()


def test_member_deploys_through_the_wizard_and_the_agent_is_asked_to_start(client, personas, node, model, no_agent,
                                                                          django_capture_on_commit_callbacks):
    client.force_login(personas.max)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/models/deploy/", form(model, node))
    deployment = Deployment.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/models/deployments/{deployment.public_id}/"
    assert deployment.owner == personas.acme.project and deployment.state == "planned"
    assert no_agent == [("start", deployment.replica_set.get().public_id)]
    page = client.get(response["Location"]).content.decode()
    assert "tiny" in page and "Events" in page


def test_viewer_cannot_deploy_and_outsider_cannot_see(client, personas, node, model, no_agent):
    client.force_login(personas.vera)
    response = client.post("/models/deploy/", form(model, node))
    assert response.status_code == 403 and not Deployment.objects.exists()
    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    client.force_login(personas.oscar)
    assert client.get(f"/models/deployments/{deployment.public_id}/").status_code == 404
    assert "tiny" not in client.get("/models/").content.decode()
    assert client.post(f"/models/deployments/{deployment.public_id}/stop/").status_code == 404
    api = client.get(f"/api/serving/deployments/{deployment.public_id}/")
    assert api.status_code == 404


def test_same_name_twice_is_refused(personas, node, model, no_agent):
    request = service.DeployRequest(name="tiny", model_path=str(model), node=node, config={"context": 256},
                                    owner=personas.acme.project)
    service.deploy(Actor(user=personas.max), request)
    from serving.errors import DeploymentConflict

    with pytest.raises(DeploymentConflict):
        service.deploy(Actor(user=personas.max), request)


def test_invalid_engine_config_lists_every_problem(client, personas, node, model):
    client.force_login(personas.max)
    response = client.post("/api/serving/deployments/", {
        "name": "tiny", "model_path": str(model), "node": node.name, "owner": "project:acme/ml/search",
        "config": {"context": 2, "colour": "blue"}}, content_type="application/json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_engine_config"
    assert "colour" in str(error["details"]) and "context" in str(error["details"])


def test_does_not_fit_is_refused_with_the_figures_and_changes_nothing(client, personas, model, no_agent):
    small = register_node(NodeReport(name="tiny-node", address="127.0.0.1", cpu_count=2,
                                     memory_total_bytes=9 * 2**30, memory_available_bytes=8 * 2**30))
    client.force_login(personas.max)
    response = client.post("/api/serving/deployments/", {
        "name": "tiny", "model_path": str(model), "node": small.name, "owner": "project:acme/ml/search",
        "config": {"context": 256}}, content_type="application/json")
    assert response.status_code in (409, 507, 503, 400)
    assert "fit" in response.json()["error"]["message"] or "memory" in response.json()["error"]["message"].lower()
    assert not Deployment.objects.exists()


def test_stop_of_a_queued_deployment_cancels_it_and_releases_its_memory(personas, node, model, no_agent):
    from scheduler.models import MemoryReservation

    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    assert MemoryReservation.objects.count() == 1
    service.stop(Actor(user=personas.max), deployment)
    deployment.refresh_from_db()
    assert deployment.state == "stopped"
    assert not MemoryReservation.objects.exists()
    service.remove(Actor(user=personas.max), deployment)
    assert not Deployment.objects.exists()


def test_switch_through_the_api_records_an_operation_for_the_worker(client, personas, node, model, no_agent,
                                                                   django_capture_on_commit_callbacks, monkeypatch):
    from serving import tasks

    queued = []
    monkeypatch.setattr(tasks.run_operation, "delay", lambda operation_id: queued.append(operation_id))
    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    Deployment.objects.filter(pk=deployment.pk).update(state="ready")
    client.force_login(personas.max)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/api/serving/deployments/{deployment.public_id}/reconfigure/",
                               {"config": {"context": 512}}, content_type="application/json")
    assert response.status_code == 202 and response.json()["kind"] == "reconfigure"
    assert queued == [response.json()["id"]]
    listed = client.get(f"/api/serving/deployments/{deployment.public_id}/operations/").json()
    assert [o["id"] for o in listed] == queued
    client.force_login(personas.vera)
    refused = client.post(f"/api/serving/deployments/{deployment.public_id}/reconfigure/",
                          {"config": {"context": 512}}, content_type="application/json")
    assert refused.status_code == 403


def test_deployment_page_reconfigures_and_lists_operations(client, personas, node, model, no_agent, monkeypatch,
                                                           django_capture_on_commit_callbacks):
    from serving import tasks
    from serving.models import Operation

    monkeypatch.setattr(tasks.run_operation, "delay", lambda operation_id: None)
    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    Deployment.objects.filter(pk=deployment.pk).update(state="ready")
    client.force_login(personas.max)
    url = f"/models/deployments/{deployment.public_id}/"
    bad = client.post(url + "reconfigure/", {"config": "[1, 2]"}, follow=True)
    assert "must be a JSON object" in bad.content.decode() and not Operation.objects.exists()
    with django_capture_on_commit_callbacks(execute=True):
        client.post(url + "reconfigure/", {"config": '{"context": 512}'})
    assert Operation.objects.get().kind == "reconfigure"
    page = client.get(url).content.decode()
    assert "Reconfigure" in page and "Running" in page


def test_wizard_offers_a_plan_that_stops_a_resident_and_deploys_after_it(client, personas, model, no_agent,
                                                                         monkeypatch, django_capture_on_commit_callbacks):
    from scheduler.models import MemoryReservation
    from serving import tasks
    from serving.models import Operation

    monkeypatch.setattr(tasks.run_operation, "delay", lambda operation_id: None)
    snug = register_node(NodeReport(name="snug", address="127.0.0.1", cpu_count=2, memory_total_bytes=9 * 2**30,
                                    memory_available_bytes=int(8.95 * 2**30)))
    Deployment.objects.create(name="sitting", model_path="/m.gguf", node=snug, state="ready", priority=10,
                              memory_reserved_bytes=2**30, owner=personas.acme.project)
    MemoryReservation.objects.create(node=snug, holder="replica:sitting", bytes=int(0.99 * 2**30))
    client.force_login(personas.max)
    preview = client.post("/models/deploy/preview/", form(model, snug), HTTP_HX_REQUEST="true").content.decode()
    assert "Does not fit" in preview and 'name="actions"' in preview and "stop sitting" in preview
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/models/deploy/", {**form(model, snug),
                                                   "actions": '[{"kind": "stop", "target": "sitting"}]'})
    assert response.status_code == 302
    operation = Operation.objects.get()
    assert operation.kind == "deploy" and operation.request["actions"] == [{"kind": "stop", "target": "sitting"}]
