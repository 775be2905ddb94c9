"""One FilterSet for the audit log (``tenancy.filtersets.AuditEventFilterSet``) and one export schema:
the console's audit page and download and the API's list and export read the same parameters the same
way, and write the same lines. A scope outside the caller's reach reads as one that does not exist."""

import json
import uuid
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from tenancy.api.serializers import AuditEventSerializer
from tenancy.models import AuditEvent
from tenancy.services import clients, contracts, tree

pytestmark = pytest.mark.django_db

AUDIT, EXPORT = "/api/tenancy/audit/", "/api/tenancy/audit/export/"


@pytest.fixture
def history(personas):
    """Changes across both organisations, by different people."""
    tree.rename_scope(personas.olivia_actor, personas.acme.team, "Machine learning")
    client = clients.create_client(personas.max_actor, personas.acme.project, "bot")
    clients.create_credential(personas.max_actor, client, name="ci")
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=8)
    tree.rename_scope(personas.oscar_actor, personas.globex.org, "Globex Corp")
    return client


def on_the_page(browser, query) -> list[str]:
    response = browser.get(reverse("tenancy:audit"), query)
    assert response.status_code == 200
    return [str(event.public_id) for event in response.context["table"].rows]


def through_the_api(caller, query) -> list[str]:
    response = caller.get(AUDIT, query)
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


def lines_of(response) -> list[dict]:
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    assert response["Content-Disposition"].startswith('attachment; filename="berth-audit-')
    return [json.loads(line) for line in b"".join(response.streaming_content).decode().splitlines()]


@pytest.mark.parametrize("persona", ["olivia", "vera", "oscar"])
def test_the_console_and_the_api_select_the_same_events_for_every_filter(personas, browse, api, history, persona):
    user = getattr(personas, persona)
    browser, caller = browse(user), api(user)
    later = (timezone.now() + timedelta(minutes=1)).isoformat()
    queries = [{}, {"actor": "max"}, {"actor": "user:olivia"}, {"actor": "OLIVIA"}, {"actor": "oli"},
               {"action": "credential"}, {"action": "scope.rename"}, {"action": "scope."}, {"since": later},
               {"until": later}, {"object": str(history.public_id)}]
    queries += {"olivia": [{"scope": "org:acme"}, {"scope": "team:acme/ml"}, {"scope": "acme/ml", "actor": "max"}],
                "vera": [{"scope": "acme/ml/search"}, {"scope": "search"},
                         {"scope": str(personas.acme.project.public_id)},
                         {"scope": "project:acme/ml/search", "action": "client"}],
                "oscar": [{"scope": "org:globex"}, {"scope": "search"}]}[persona]
    selected = set()
    for query in queries:
        page = on_the_page(browser, query)
        assert page == through_the_api(caller, query), query
        selected |= set(page)
    assert selected == {str(e.public_id) for e in AuditEvent.objects.all()
                        if e.scope_path.startswith("globex" if persona == "oscar" else
                                                   "acme/ml/search" if persona == "vera" else "acme")}


@pytest.mark.parametrize("written, unknown", [("org:acme", "org:initech"), ("acme/ml", "initech/ml"),
                                              ("team:acme/ml", "team:initech/ml"), ("acme", "initech")])
def test_an_outsiders_scope_filter_selects_nothing_and_reads_as_a_scope_that_does_not_exist(
        personas, browse, api, history, written, unknown):
    browser, caller = browse(personas.oscar), api(personas.oscar)
    acme_says = [text for text in [e.object_repr for e in AuditEvent.objects.filter(scope_path__startswith="acme")]
                 + ["olivia", "max"] if text not in written]  # one's own words echoed tell nothing

    page = browser.get(reverse("tenancy:audit"), {"scope": written})
    missing = browser.get(reverse("tenancy:audit"), {"scope": unknown})
    for response in (page, missing):
        assert response.status_code == 200 and list(response.context["table"].rows) == []
    said = page.context["filterset"].form.non_field_errors()
    assert list(said) == [e.replace(repr(unknown), repr(written))
                          for e in missing.context["filterset"].form.non_field_errors()]
    assert said[0] == f"No scope {written!r}, or it is outside your reach."
    assert not [text for text in acme_says if text in page.content.decode()]

    for url in (AUDIT, EXPORT):
        hidden, absent = caller.get(url, {"scope": written}), caller.get(url, {"scope": unknown})
        assert hidden.status_code == absent.status_code == 404
        assert json.loads(hidden.content)["error"] == {**json.loads(absent.content)["error"], "message": said[0]}
        assert not [text for text in acme_says if text in hidden.content.decode()]
    assert browser.get(reverse("tenancy:audit_export"), {"scope": written}).status_code == 404


def test_an_outsiders_scope_by_id_reads_as_an_id_that_does_not_exist(personas, browse, api, history):
    hidden, absent = str(personas.acme.org.public_id), str(uuid.uuid4())
    page = browse(personas.oscar).get(reverse("tenancy:audit"), {"scope": hidden})
    assert list(page.context["table"].rows) == []
    assert list(page.context["filterset"].form.non_field_errors()) == [
        f"No scope {hidden!r}, or it is outside your reach."]
    answers = [api(personas.oscar).get(AUDIT, {"scope": scope}).json()["error"] for scope in (hidden, absent)]
    assert answers[0] == {**answers[1], "message": answers[1]["message"].replace(absent, hidden)}


@pytest.mark.parametrize("query, code", [({"scope": "galaxy:acme"}, "unknown_scope_kind"),
                                         ({"since": "yesterday-ish"}, "invalid")])
def test_a_filter_the_console_cannot_read_shows_nothing_and_says_why(personas, browse, api, history, query, code):
    page = browse(personas.olivia).get(reverse("tenancy:audit"), query)
    assert page.status_code == 200 and list(page.context["table"].rows) == []
    assert page.context["filterset"].form.errors
    refused = api(personas.olivia).get(AUDIT, query)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == code
    assert browse(personas.olivia).get(reverse("tenancy:audit_export"), query).status_code == 400


@pytest.mark.parametrize("query", [{}, {"scope": "team:acme/ml"}, {"action": "credential"}, {"actor": "max"}])
def test_the_console_download_and_the_api_export_write_the_same_lines(personas, browse, api, history, query):
    downloaded = lines_of(browse(personas.olivia).get(reverse("tenancy:audit_export"), query))
    exported = lines_of(api(personas.olivia).get(EXPORT, query, HTTP_ACCEPT="application/x-ndjson"))
    assert downloaded == exported and downloaded
    # Each line is the event as the API's list shows it, oldest first.
    listed = api(personas.olivia).get(AUDIT, query).json()["results"]
    assert downloaded == list(reversed(listed))
    assert all(set(line) == set(AuditEventSerializer().fields) for line in downloaded)
