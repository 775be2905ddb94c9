"""The deployment page offers only what the deployment's state allows, to those whose role allows it;
a verb posted anyway is refused with the reason and changes nothing; each outcome is said in place
(an htmx swap of the buttons) or, without JavaScript, on the page a plain POST goes back to."""

from __future__ import annotations

import re
import shutil

import pytest
from django.db import transaction

from scheduler.models import MemoryReservation
from scheduler.services import NodeReport, register_node
from serving import queues
from serving.deployments import actions, service
from serving.errors import DeploymentConflict, SleepNotSupported
from serving.models import Deployment, DeploymentState as S, Replica
from serving.models.states import SERVING
from tenancy.audit import Actor
from tenancy.models import AuditEvent

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
def sent(monkeypatch):
    """Nothing consumes the node's queue here: what would have been sent to the agent."""
    sent = []
    monkeypatch.setattr(queues, "to_node", lambda operation, replica: sent.append((operation, replica.public_id)))
    return sent


@pytest.fixture
def deployment(personas, node, model, sent):
    """tiny, deployed by max (member of acme/ml) for acme/ml/search: planned, its start sent."""
    made = service.deploy(Actor(user=personas.max), service.DeployRequest(
        name="tiny", model_path=str(model), node=node, config={"context": 256}, owner=personas.acme.project))
    sent.clear()
    return made


def put_in(deployment, state):
    """The deployment and its replica in ``state``, as the agent would have left them."""
    Replica.objects.filter(deployment=deployment).update(state=state)
    Deployment.objects.filter(pk=deployment.pk).update(state=state)
    deployment.refresh_from_db()
    return deployment


def buttons(html: str) -> dict[str, str]:
    """{verb: the form's markup} of the actions panel."""
    panel = html[html.index('id="deployment-buttons"'):]
    panel = panel[:panel.index("</div>")]
    return {verb: form for form, verb in
            ((f, re.search(r'data-verb="(\w+)"', f).group(1)) for f in re.findall(r"<form.*?</form>", panel, re.S))}


def label(form: str) -> str:
    return re.sub(r"<[^>]+>", "", re.search(r"<button[^>]*>(.*?)</button>", form, re.S).group(1)).strip()


def page_of(client, deployment) -> str:
    response = client.get(f"/models/deployments/{deployment.public_id}/")
    assert response.status_code == 200
    body = response.content.decode()
    assert not template_text(body)
    return body


def template_text(html: str) -> list[str]:
    """Template syntax that reached the page (a comment that is not one, a tag left unrendered)."""
    return re.findall(r"\{[#%].{0,40}", html)


def test_a_stopped_deployment_offers_start_and_remove_not_stop_and_remove_is_labelled_and_confirms(
        client, personas, deployment):
    service.stop(Actor(user=personas.max), deployment)  # planned: cancelled at once
    client.force_login(personas.max)
    offered = buttons(page_of(client, deployment))
    assert sorted(offered) == ["remove", "start"]
    assert label(offered["start"]) == "Start" and label(offered["remove"]) == "Remove"
    assert 'class="danger"' in offered["remove"] and 'type="submit"' in offered["remove"]
    assert 'hx-confirm="Remove tiny?' in offered["remove"] and "hx-confirm" not in offered["start"]
    # A plain POST works without JavaScript: each button is a form posting to its verb.
    assert f'action="/models/deployments/{deployment.public_id}/remove/"' in offered["remove"]


def test_a_ready_deployment_offers_stop_not_start_and_reconfigure(client, personas, deployment):
    put_in(deployment, S.READY)
    client.force_login(personas.max)
    page = page_of(client, deployment)
    offered = buttons(page)
    assert sorted(offered) == ["stop"]  # llama.cpp cannot sleep; a running one is stopped before it goes
    assert label(offered["stop"]) == "Stop" and 'hx-confirm="Stop tiny?' in offered["stop"]
    assert 'name="config"' in page  # reconfigure: only a ready or sleeping one


def test_a_sleeping_vllm_deployment_offers_wake_and_stop_and_a_ready_one_sleep(client, personas, node):
    asleep = Deployment.objects.create(name="big", engine="vllm", model_path="/m/big", node=node, state="sleeping",
                                       owner=personas.acme.project)
    Replica.objects.create(deployment=asleep, node=node, port=21001, state="sleeping")
    client.force_login(personas.max)
    assert sorted(buttons(page_of(client, asleep))) == ["stop", "wake"]
    put_in(asleep, S.READY)
    assert sorted(buttons(page_of(client, asleep))) == ["sleep", "stop"]


def test_a_viewer_sees_the_deployment_but_no_button_and_is_told_what_acting_takes(client, personas, deployment):
    put_in(deployment, S.READY)
    client.force_login(personas.vera)
    page = page_of(client, deployment)
    assert buttons(page) == {} and 'name="config"' not in page
    assert "Acting on it takes member (or above) of project:acme/ml/search." in page
    client.force_login(personas.oscar)  # another organisation's owner: not even the page
    assert client.get(f"/models/deployments/{deployment.public_id}/").status_code == 404


def test_a_verb_the_state_does_not_take_is_refused_with_its_reason_and_changes_nothing(client, personas, deployment,
                                                                                      sent):
    put_in(deployment, S.READY)
    url = f"/models/deployments/{deployment.public_id}/"
    client.force_login(personas.max)
    audited, held = AuditEvent.objects.count(), list(MemoryReservation.objects.values_list("holder", "bytes"))
    for verb, reason in (("start", "tiny is ready: only a stopped or failed deployment starts."),
                         ("remove", "tiny is ready: stop it before removing it."),
                         ("sleep", "llama.cpp cannot sleep"),
                         ("wake", "tiny is ready: only a sleeping deployment wakes.")):
        plain = client.post(url + f"{verb}/", follow=True)  # without JavaScript: said on the page
        assert plain.redirect_chain == [(url, 302)], verb
        assert [m.message for m in plain.context["messages"]][0].startswith(reason), verb
        swapped = client.post(url + f"{verb}/", HTTP_HX_REQUEST="true").content.decode()  # with htmx: in place
        assert 'id="deployment-buttons"' in swapped and "<html" not in swapped, verb
        assert 'role="alert"' in swapped and reason in swapped, verb
        assert sorted(buttons(swapped)) == ["stop"], verb
    put_in(deployment, S.STOPPED)
    stop = client.post(url + "stop/", HTTP_HX_REQUEST="true").content.decode()
    assert "tiny is stopped: nothing runs to stop." in stop
    # Nothing changed: no audit event, no replica, no memory, nothing sent to the agent.
    assert AuditEvent.objects.count() == audited and sent == []
    assert Replica.objects.filter(deployment=deployment).count() == 1
    assert list(MemoryReservation.objects.values_list("holder", "bytes")) == held
    assert Deployment.objects.get(pk=deployment.pk).state == S.STOPPED


def test_a_viewer_posting_anyway_is_told_their_role_before_the_state(client, personas, deployment):
    put_in(deployment, S.STOPPED)
    client.force_login(personas.vera)
    swapped = client.post(f"/models/deployments/{deployment.public_id}/stop/", HTTP_HX_REQUEST="true")
    assert swapped.status_code == 200 and "Your role does not allow" in swapped.content.decode()
    assert buttons(swapped.content.decode()) == {}


def test_stop_then_remove_in_place_the_buttons_follow_the_state(client, personas, deployment):
    url = f"/models/deployments/{deployment.public_id}/"
    client.force_login(personas.max)
    assert sorted(buttons(page_of(client, deployment))) == ["remove", "stop"]  # planned: nothing runs yet
    stopped = client.post(url + "stop/", HTTP_HX_REQUEST="true")
    body = stopped.content.decode()
    assert stopped.status_code == 200 and stopped["Vary"].count("HX-Request") == 1 and not template_text(body)
    assert 'role="status"' in body and "tiny stopped." in body
    assert sorted(buttons(body)) == ["remove", "start"]
    # The live panel and the result come along out of band; the page itself is not re-sent.
    assert 'id="deployment-live" class="panel" hx-swap-oob="true"' in body and "Stopped" in body
    assert 'id="action-result" aria-live="polite" hx-swap-oob="true"' in body
    assert not list(client.get(url).context["messages"])  # said in place, not again on the next page
    started = client.post(url + "start/", HTTP_HX_REQUEST="true").content.decode()
    assert "tiny is starting." in started
    # Its fresh replica speaks for it before the agent moves it: no second Start to press.
    assert sorted(buttons(started)) == ["remove", "stop"]
    refused = client.post(url + "start/", HTTP_HX_REQUEST="true").content.decode()
    assert "tiny is planned: only a stopped or failed deployment starts." in refused
    assert Replica.objects.filter(deployment=deployment, state="planned").count() == 1
    client.post(url + "stop/", HTTP_HX_REQUEST="true")
    removed = client.post(url + "remove/", HTTP_HX_REQUEST="true")
    assert removed.status_code == 204 and removed["HX-Redirect"] == "/models/"
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert "tiny removed." in client.get("/models/").content.decode()  # said on the list it goes to


def test_the_live_panel_brings_the_buttons_for_the_new_state(client, personas, deployment):
    client.force_login(personas.max)
    put_in(deployment, S.READY)
    live = client.get(f"/models/deployments/{deployment.public_id}/", HTTP_HX_REQUEST="true").content.decode()
    assert '<section id="deployment-live" class="panel" hx-get' in live and not template_text(live)
    assert '<div id="deployment-buttons" class="actions" hx-swap-oob="true">' in live
    assert sorted(buttons(live)) == ["stop"] and 'name="config"' in live


@pytest.mark.parametrize("state", list(S))
def test_the_rule_the_buttons_follow_agrees_with_the_services_refusals(state, personas, node, settings, sent):
    """For every state: what ``actions`` allows, the service does; what it refuses, the service refuses."""
    settings.SERVING_WAKE_WAIT_SECONDS = 0  # a wake is only asked for here: nothing wakes it
    member = Actor(user=personas.max)
    for engine in ("llamacpp", "vllm"):
        deployment = Deployment.objects.create(name=f"rule-{engine}", engine=engine, model_path="/m/model",
                                               node=node, state=state, owner=personas.acme.project,
                                               memory_reserved_bytes=2**30)
        Replica.objects.create(deployment=deployment, node=node, port=22000 + len(engine), state=state)
        for verb, call in (("start", service.start), ("sleep", service.sleep), ("wake", service.wake),
                           ("remove", service.remove)):
            expected = actions.refusal(deployment, verb)
            try:
                with transaction.atomic():
                    call(member, Deployment.objects.get(pk=deployment.pk))
                    raise _Undo
            except _Undo:
                refused = None
            except (DeploymentConflict, SleepNotSupported) as error:
                refused = error
            assert (refused is None) == (expected is None), (state, engine, verb, refused, expected)
            if refused is not None:
                assert type(refused) is type(expected) and refused.message == expected.message
        stops = actions.refusal(deployment, "stop") is None
        assert stops == (state in SERVING), (state, engine)  # what ``service.stop`` stops


class _Undo(Exception):
    """Leaves the verb's transaction without keeping what it did."""
