"""The Batch API's batches for their project's people: ``/api/gateway/batches/`` (list, retrieve,
cancel) and the console's Batches pages. Who sees a batch is the rule of usage (the scopes where one
holds a role); cancelling takes member (or above) of the batch's project and leaves an audit event;
another organisation's owner never learns that a batch exists. No engine runs: the batches are rows,
and no worker is asked to run them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from rest_framework.test import APIClient
from django.utils import timezone

from gateway.batch.files import new_id
from gateway.models import Batch
from tenancy.models import AuditEvent
from tenancy.services import clients, tree

pytestmark = pytest.mark.django_db

API = "/api/gateway/batches/"


@pytest.fixture
def no_runs(monkeypatch):
    """What a cancel would queue for a worker, recorded instead of sent (the runner has tests of its own)."""
    queued = []
    monkeypatch.setattr("gateway.batch.service.enqueue", queued.append)
    return queued


@pytest.fixture
def make_batch(personas):
    """``make_batch(project=acme/ml/search, status="in_progress", **fields)``: a batch of a fresh client
    of that project (made by its organisation's owner), as ``POST /v1/batches`` would leave it."""
    owners = {"acme": personas.olivia_actor, "globex": personas.oscar_actor}
    counter = iter(range(1, 1000))

    def make(project=None, status=Batch.Status.IN_PROGRESS, **fields):
        project = project or personas.acme.project
        actor = owners[project.path.split("/")[0]]
        client = clients.create_client(actor, project, f"batcher-{next(counter)}", all_models=True)
        credential, _ = clients.create_credential(actor, client, name="batch")
        now = timezone.now()
        fields = {"endpoint": "/v1/chat/completions", "total": 10, "completed": 4, "failed": 1,
                  "in_progress_at": now - timedelta(seconds=50), **fields}
        return Batch.objects.create(public_id=new_id("batch_"), completion_window="24h", status=status,
                                    credential=credential, client=client, scope_path=project.path,
                                    expires_at=now + timedelta(hours=24), **fields)

    return make


def api_as(user=None, key=None):
    client = APIClient()
    client.default_format = "json"
    if user is not None:
        client.force_login(user)
    if key is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def browse(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def ids(answer) -> list[str]:
    assert answer.status_code == 200, answer.content
    return [row["id"] for row in answer.json()["results"]]


def cancel_events(batch):
    return AuditEvent.objects.filter(action="batch.cancel", object_id=batch.public_id)


# --- the management API ------------------------------------------------------------------------------

def test_the_owner_lists_filters_reads_and_cancels_a_batch(personas, make_batch, no_runs):
    running = make_batch()
    done = make_batch(status=Batch.Status.COMPLETED, total=3, completed=3, failed=0,
                      endpoint="/v1/embeddings", completed_at=timezone.now())
    elsewhere = make_batch(project=personas.globex.project)
    olivia = api_as(personas.olivia)

    assert ids(olivia.get(API)) == [done.public_id, running.public_id]  # newest first, none of globex's
    assert ids(olivia.get(API, {"status": "in_progress"})) == [running.public_id]
    assert ids(olivia.get(API, {"active": "false"})) == [done.public_id]
    assert ids(olivia.get(API, {"endpoint": "/v1/embeddings"})) == [done.public_id]
    assert ids(olivia.get(API, {"scope": "acme/ml"})) == [done.public_id, running.public_id]
    assert ids(olivia.get(API, {"scope": "acme/ml/other"})) == []
    assert ids(olivia.get(API, {"client": str(running.client.public_id)})) == [running.public_id]
    assert olivia.get(API, {"status": "sleeping"}).status_code == 400

    read = olivia.get(f"{API}{running.public_id}/")
    assert read.status_code == 200, read.content
    body = read.json()
    assert (body["id"], body["status"], body["endpoint"], body["scope_path"]) == (
        running.public_id, "in_progress", "/v1/chat/completions", "acme/ml/search")
    assert body["client"] == str(running.client.public_id) and body["client_name"] == running.client.name
    assert body["request_counts"] == {"total": 10, "completed": 4, "failed": 1}
    assert body["key_prefix"] == running.credential.prefix
    assert 40 <= body["eta_seconds"] <= 80  # five lines in about 50 s: about 50 s for the five left
    assert olivia.get(f"{API}{done.public_id}/").json()["eta_seconds"] is None  # unknown, not zero
    assert olivia.get(f"{API}{elsewhere.public_id}/").status_code == 404

    cancelled = olivia.post(f"{API}{running.public_id}/cancel/")
    assert cancelled.status_code == 200, cancelled.content
    assert cancelled.json()["status"] == "cancelling" and cancelled.json()["cancelling_at"]
    running.refresh_from_db()
    assert running.status == Batch.Status.CANCELLING and no_runs == [running.public_id]
    [event] = cancel_events(running)
    assert (event.actor, event.scope_path, event.object_type) == ("user:olivia", "acme/ml/search", "gateway.batch")
    assert event.details["was"] == "in_progress" and event.details["client"] == str(running.client.public_id)

    again = olivia.post(f"{API}{running.public_id}/cancel/")  # already cancelling: nothing changes
    assert again.status_code == 200 and cancel_events(running).count() == 1


def test_cancelling_an_ended_batch_is_a_clear_conflict_that_changes_nothing(personas, make_batch, no_runs):
    done = make_batch(status=Batch.Status.COMPLETED, completed=9, failed=1, completed_at=timezone.now())
    answer = api_as(personas.olivia).post(f"{API}{done.public_id}/cancel/")
    assert answer.status_code == 409, answer.content
    error = answer.json()["error"]
    assert error["code"] == "batch_ended" and "already ended (completed)" in error["message"]
    assert error["details"] == {"batch": done.public_id, "status": "completed"}
    done.refresh_from_db()
    assert done.status == Batch.Status.COMPLETED and not cancel_events(done).exists() and no_runs == []


def test_another_orgs_owner_gets_404_and_sees_none_of_them(personas, make_batch, no_runs):
    batch = make_batch()
    oscar = api_as(personas.oscar)
    assert ids(oscar.get(API)) == []
    assert ids(oscar.get(API, {"scope": "acme"})) == []
    for answer in (oscar.get(f"{API}{batch.public_id}/"), oscar.post(f"{API}{batch.public_id}/cancel/")):
        assert answer.status_code == 404, answer.content
        assert answer.json()["error"]["code"] == "not_found" and batch.public_id not in answer.content.decode()
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and not cancel_events(batch).exists() and no_runs == []


def test_a_viewer_lists_and_reads_but_may_not_cancel(personas, make_batch, no_runs):
    batch = make_batch()
    vera = api_as(personas.vera)
    assert ids(vera.get(API)) == [batch.public_id]
    assert vera.get(f"{API}{batch.public_id}/").status_code == 200
    refused = vera.post(f"{API}{batch.public_id}/cancel/")
    assert refused.status_code == 403, refused.content
    assert refused.json()["error"]["code"] == "permission_denied"
    assert refused.json()["error"]["details"] == {"action": "use", "needs": "member"}
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and not cancel_events(batch).exists() and no_runs == []
    # A member of the team above acts.
    assert api_as(personas.max).post(f"{API}{batch.public_id}/cancel/").status_code == 200
    assert cancel_events(batch).get().actor == "user:max"


def test_a_management_key_sees_and_cancels_its_own_projects_batches_only(personas, make_batch, no_runs):
    mine = make_batch()
    sibling = tree.create_scope(personas.olivia_actor, "project", "other", "Other", personas.acme.team)
    theirs = make_batch(project=sibling)
    client = clients.create_client(personas.olivia_actor, personas.acme.project, "robot", access="management")
    _, key = clients.create_credential(personas.olivia_actor, client, name="ci")
    robot = api_as(key=key)

    assert ids(robot.get(API)) == [mine.public_id]
    assert robot.get(f"{API}{theirs.public_id}/").status_code == 404
    assert robot.post(f"{API}{theirs.public_id}/cancel/").status_code == 404
    answer = robot.post(f"{API}{mine.public_id}/cancel/")
    assert answer.status_code == 200, answer.content
    assert cancel_events(mine).get().actor == f"client:{client}"
    theirs.refresh_from_db()
    assert theirs.status == Batch.Status.IN_PROGRESS and no_runs == [mine.public_id]


def test_an_inference_key_is_not_a_way_into_the_management_api(personas, make_batch, no_runs):
    batch = make_batch()
    _, key = clients.create_credential(personas.olivia_actor, batch.client, name="inference")
    answer = api_as(key=key).get(API)
    assert answer.status_code in (401, 403), answer.content
    assert batch.public_id not in answer.content.decode()


# --- the console -------------------------------------------------------------------------------------

def test_the_batches_page_lists_a_members_batches_one_line_each_and_hides_other_orgs(personas, make_batch):
    running = make_batch()
    elsewhere = make_batch(project=personas.globex.project)
    page = browse(personas.max).get("/gateway/batches/")
    assert page.status_code == 200
    html = page.content.decode()
    assert running.public_id in html and running.client.name in html and elsewhere.public_id not in html
    assert f'href="/gateway/batches/{running.public_id}/"' in html
    assert "5 / 10 (1 failed)" in html and "/v1/chat/completions" in html
    assert 'aria-current="page">Batches<' in html  # the Gateway area's section, marked
    oscar = browse(personas.oscar).get("/gateway/batches/").content.decode()
    assert elsewhere.public_id in oscar and running.public_id not in oscar and "acme" not in oscar
    filtered = browse(personas.max).get("/gateway/batches/", {"status": "completed"}).content.decode()
    assert running.public_id not in filtered and "No batches match these filters." in filtered


def test_the_batch_page_shows_progress_and_a_cancel_button_only_to_those_allowed(personas, make_batch):
    batch = make_batch()
    url = f"/gateway/batches/{batch.public_id}/"
    member = browse(personas.max).get(url)
    assert member.status_code == 200
    html = member.content.decode()
    assert f'action="{url}cancel/"' in html and "Cancel batch" in html and "csrfmiddlewaretoken" in html
    assert 'aria-label="Breadcrumb"' in html and 'href="/gateway/batches/"' in html
    viewer = browse(personas.vera).get(url).content.decode()
    assert batch.public_id in viewer and "Cancel batch" not in viewer and "takes member (or above)" in viewer
    assert browse(personas.oscar).get(url).status_code == 404
    # Polled while it runs; once ended, the fragment answers 286 and htmx stops.
    assert browse(personas.max).get(url, HTTP_HX_REQUEST="true").status_code == 200
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.CANCELLED, cancelled_at=timezone.now())
    ended = browse(personas.max).get(url, HTTP_HX_REQUEST="true")
    assert ended.status_code == 286 and "Cancel batch" not in ended.content.decode()


def test_cancel_from_the_console_swaps_the_panel_and_writes_the_audit_event(personas, make_batch, no_runs):
    batch = make_batch()
    url = f"/gateway/batches/{batch.public_id}/cancel/"
    max_ = browse(personas.max)
    answer = max_.post(url, HTTP_HX_REQUEST="true")
    assert answer.status_code == 200, answer.content
    html = answer.content.decode()
    assert 'id="batch-panel"' in html and "is cancelling" in html and 'data-status="cancelling"' in html
    assert "Cancel batch" not in html  # cancelling: nothing more to press
    batch.refresh_from_db()
    assert batch.status == Batch.Status.CANCELLING and no_runs == [batch.public_id]
    assert cancel_events(batch).get().actor == "user:max"

    # Without JavaScript: back to the batch's page, which says so.
    other = make_batch()
    plain = max_.post(f"/gateway/batches/{other.public_id}/cancel/", follow=True)
    assert plain.redirect_chain[-1][0] == f"/gateway/batches/{other.public_id}/"
    assert "is cancelling" in plain.content.decode()


def test_console_cancel_refusals_change_nothing(personas, make_batch, no_runs):
    batch = make_batch()
    url = f"/gateway/batches/{batch.public_id}/cancel/"
    assert browse(personas.oscar).post(url).status_code == 404
    assert browse(personas.vera).post(url).status_code == 403
    ended = make_batch(status=Batch.Status.FAILED, failed_at=timezone.now())
    said = browse(personas.max).post(f"/gateway/batches/{ended.public_id}/cancel/", HTTP_HX_REQUEST="true")
    assert said.status_code == 200 and "has already ended (failed)" in said.content.decode()
    batch.refresh_from_db()
    ended.refresh_from_db()
    assert (batch.status, ended.status) == (Batch.Status.IN_PROGRESS, Batch.Status.FAILED)
    assert not AuditEvent.objects.filter(action="batch.cancel").exists() and no_runs == []


def test_a_forged_cancel_without_the_csrf_token_is_refused(personas, make_batch, no_runs):
    batch = make_batch()
    client = Client(enforce_csrf_checks=True)
    client.force_login(personas.max)
    assert client.post(f"/gateway/batches/{batch.public_id}/cancel/").status_code == 403
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and no_runs == []
