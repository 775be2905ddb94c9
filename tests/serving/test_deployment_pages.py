"""The Models area and the deployments API: who sees what, the wizard's preview, refusals."""

from __future__ import annotations

import shutil

import pytest
from django.utils.html import escape

from scheduler.services import NodeReport, register_node
from serving import queues
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
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.public_id)))
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
    queued = []
    monkeypatch.setattr(queues, "to_control", lambda task, operation_id: queued.append(operation_id))
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

    monkeypatch.setattr(queues, "to_control", lambda task, operation_id: None)
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


def test_switch_and_reconfigure_refuse_a_b_that_does_not_fit_in_as_place_and_change_nothing(
        client, personas, model, no_agent, monkeypatch, django_capture_on_commit_callbacks):
    from scheduler import memory
    from scheduler.models import MemoryReservation
    from serving.models import Operation
    from tenancy.models import AuditEvent

    queued = []
    monkeypatch.setattr(queues, "to_control", lambda task, operation_id: queued.append(operation_id))
    # Nothing measured outside Berth: the fit is reservations and the margin only.
    roomy = register_node(NodeReport(name="roomy", address="127.0.0.1", cpu_count=8, memory_total_bytes=64 * 2**30,
                                     memory_available_bytes=64 * 2**30))
    member = Actor(user=personas.max)
    a = service.deploy(member, service.DeployRequest(name="tiny", model_path=str(model), node=roomy,
                                                     config={"context": 256}, owner=personas.acme.project))
    Deployment.objects.filter(pk=a.pk).update(state="ready")
    a.refresh_from_db()
    larger = service.DeployRequest.of(a, config={"context": 512})
    wanted = service.preview(member, larger).estimate.total_bytes
    # Taken by others: with ``taken``, B fits only if A's memory counts as free; with A's more, not even then.
    taken = memory.budget_for(roomy).free_for_new - wanted + a.memory_reserved_bytes // 2
    hog = MemoryReservation.objects.create(node=roomy, holder="elsewhere", bytes=taken + a.memory_reserved_bytes)
    held = sorted(MemoryReservation.objects.values_list("holder", "bytes"))
    client.force_login(personas.max)
    url = f"/api/serving/deployments/{a.public_id}/"
    for verb, body, status, code in (
            ("reconfigure", {"config": {"context": 512}}, 409, "insufficient_memory"),
            ("switch", {"model_path": str(model), "config": {"context": 512}}, 409, "insufficient_memory"),
            ("switch", {"model_path": str(model.parent / "missing.gguf")}, 404, "model_not_found"),
            ("switch", {"model_path": str(model), "config": {"context": 2, "colour": "blue"}}, 400,
             "invalid_engine_config")):
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post(url + f"{verb}/", body, content_type="application/json")
        assert response.status_code == status, (verb, body, response.content)
        error = response.json()["error"]
        assert error["code"] == code
        if code == "insufficient_memory":
            assert not error["details"]["fit"]["fits"] and "plans" in error["details"]["fit"]
    page = client.post(f"/models/deployments/{a.public_id}/reconfigure/", {"config": '{"context": 512}'},
                       follow=True).content.decode()
    assert "does not fit" in page
    # Nothing changed: no operation, no audit of a switch, A's replica and every reservation as they were.
    assert not Operation.objects.exists() and queued == []
    assert not AuditEvent.objects.filter(action__in=("deployment.switch", "deployment.reconfigure")).exists()
    assert sorted(MemoryReservation.objects.values_list("holder", "bytes")) == held
    assert Deployment.objects.get().state == "ready" and no_agent == []  # no stop was sent to A's node

    # With A's memory less taken, a fresh deploy still would not fit, but B fits in A's place.
    MemoryReservation.objects.filter(pk=hog.pk).update(bytes=taken)
    assert not service.preview(member, larger).fit.fits
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(url + "reconfigure/", {"config": {"context": 512}}, content_type="application/json")
    assert response.status_code == 202 and queued == [response.json()["id"]]
    assert Deployment.objects.get().state == "ready"  # A is stopped only by the worker, once B is known to fit


def test_switch_through_the_api_keeps_as_accelerators_on_its_node_only(client, personas, node, model, no_agent,
                                                                       monkeypatch):
    from scheduler.models import Accelerator
    from serving.models import Operation

    monkeypatch.setattr(queues, "to_control", lambda task, operation_id: None)
    card = Accelerator.objects.create(node=node, index=0, uuid="GPU-stand-in-0", name="NVIDIA H100 80GB HBM3",
                                      accelerator_class="H100-80GB", memory_total_bytes=80 * 2**30)
    a = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, accelerator=card,
        owner=personas.acme.project, profile="gpu"))
    Deployment.objects.filter(pk=a.pk).update(state="ready")
    other = register_node(NodeReport(name="cpu-02", address="127.0.0.1", cpu_count=8, memory_total_bytes=64 * 2**30,
                                     memory_available_bytes=60 * 2**30))
    other_card = Accelerator.objects.create(node=other, index=0, uuid="GPU-stand-in-1", name="NVIDIA H100 80GB HBM3",
                                            accelerator_class="H100-80GB", memory_total_bytes=80 * 2**30)
    client.force_login(personas.max)
    url = f"/api/serving/deployments/{a.public_id}/switch/"
    for body, accelerators in (({"model_path": str(model)}, [card.uuid]),  # B stays: A's card comes along
                               ({"model_path": str(model), "node": other.name}, []),  # it cannot follow B
                               ({"model_path": str(model), "node": other.name, "accelerator": other_card.uuid},
                                [other_card.uuid])):
        response = client.post(url, body, content_type="application/json")
        assert response.status_code == 202, response.content
        request = Operation.objects.get(public_id=response.json()["id"]).request
        assert request["accelerators"] == accelerators and request["profile"] == "gpu"
        assert request["name"] == "tiny" and request["owner"] == personas.acme.project.pk
        Operation.objects.update(state=Operation.State.SUCCEEDED)  # the worker is done with it
    refused = client.post(url, {"model_path": str(model), "accelerator": other_card.uuid},
                          content_type="application/json")
    assert refused.status_code == 400 and refused.json()["error"]["details"] == {"accelerator": "unknown"}


def test_wizard_offers_a_plan_that_stops_a_resident_and_deploys_after_it(client, personas, model, no_agent,
                                                                         monkeypatch, django_capture_on_commit_callbacks):
    from scheduler.models import MemoryReservation
    from serving import tasks
    from serving.models import Operation

    monkeypatch.setattr(queues, "to_control", lambda task, operation_id: None)
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


def test_a_body_with_a_field_the_endpoint_does_not_take_is_refused_naming_it_and_changes_nothing(
        client, personas, node, model, no_agent):
    from serving.models import Operation

    client.force_login(personas.max)
    body = {"name": "tiny", "model_path": str(model), "node": node.name, "owner": "project:acme/ml/search",
            "config": {"context": 256}}
    for url in ("/api/serving/deployments/", "/api/serving/deployments/preview/"):
        refused = client.post(url, {**body, "replicas": 3}, content_type="application/json")
        assert refused.status_code == 400, refused.content
        assert refused.json()["error"]["details"] == {"replicas": ["This field is not accepted here."]}
    assert not Deployment.objects.exists() and no_agent == []
    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    Deployment.objects.filter(pk=deployment.pk).update(state="ready")
    url = f"/api/serving/deployments/{deployment.public_id}/"
    for verb, sent in (("switch", {"model_path": str(model), "name": "renamed"}),
                       ("reconfigure", {"config": {"context": 512}, "node": "cpu-02"})):
        refused = client.post(url + f"{verb}/", sent, content_type="application/json")
        assert refused.status_code == 400 and list(refused.json()["error"]["details"]) == [
            next(iter(set(sent) - {"model_path", "config"}))], refused.content
    assert not Operation.objects.exists()


def test_a_deployment_is_found_by_its_id_only_and_an_outsider_is_told_404_whatever_the_body(
        client, personas, node, model, no_agent):
    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    client.force_login(personas.max)
    assert client.get(f"/api/serving/deployments/{deployment.public_id.hex}/").status_code == 200
    for other in ("tiny", str(deployment.pk), "not-a-uuid"):
        assert client.get(f"/api/serving/deployments/{other}/").status_code == 404
    client.force_login(personas.oscar)
    for verb, sent in (("reconfigure", {}), ("reconfigure", {"config": {"context": 512}, "colour": "blue"}),
                       ("switch", {"model_path": str(model)})):
        answer = client.post(f"/api/serving/deployments/{deployment.public_id}/{verb}/", sent,
                             content_type="application/json")
        assert answer.status_code == 404 and "tiny" not in answer.content.decode()


def test_console_actions_say_a_refusal_on_the_deployment_page_and_remove_goes_back_to_the_list(
        client, personas, node, model, no_agent):
    deployment = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    page = f"/models/deployments/{deployment.public_id}/"
    client.force_login(personas.vera)  # a viewer: sees it, may not stop it
    refused = client.post(page + "stop/", follow=True)
    assert refused.redirect_chain == [(page, 302)]
    said = [m.message for m in refused.context["messages"]]
    assert len(said) == 1 and escape(said[0]) in refused.content.decode()
    assert Deployment.objects.get(pk=deployment.pk).state == "planned"
    assert client.post(page + "explode/").status_code == 404
    client.force_login(personas.max)
    removed = client.post(page + "remove/", follow=True)  # planned: nothing runs, it may go at once
    assert removed.redirect_chain == [("/models/", 302)] and "tiny removed." in removed.content.decode()
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
