"""The audit log through the management API: read-only, narrowed to the caller's scopes,
filterable, exportable as JSON lines."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from tenancy.models import AuditEvent
from tenancy.services import clients, contracts, tree

pytestmark = pytest.mark.django_db

AUDIT = "/api/tenancy/audit/"


@pytest.fixture
def history(personas):
    """A few changes across both organisations, by different people."""
    tree.rename_scope(personas.olivia_actor, personas.acme.team, "Machine learning")
    client = clients.create_client(personas.max_actor, personas.acme.project, "bot")
    clients.create_credential(personas.max_actor, client, name="ci")
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=8)
    tree.rename_scope(personas.oscar_actor, personas.globex.org, "Globex Corp")
    return client


def actions(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["action"] for row in response.json()["results"]]


def test_each_persona_reads_only_the_events_of_their_scopes(personas, api, history):
    assert actions(api(personas.olivia).get(AUDIT)) == ["contract.set", "credential.create", "client.create",
                                                         "scope.rename"]
    assert actions(api(personas.vera).get(AUDIT)) == ["credential.create", "client.create"]
    assert actions(api(personas.oscar).get(AUDIT)) == ["scope.rename"]


def test_outsider_gets_404_for_another_orgs_event(personas, api, history):
    event = AuditEvent.objects.get(action="contract.set")
    assert api(personas.oscar).get(f"{AUDIT}{event.public_id}/").status_code == 404
    assert api(personas.olivia).get(f"{AUDIT}{event.public_id}/").json()["scope"] == "acme"


def test_the_log_is_read_only(personas, api, history):
    olivia = api(personas.olivia)
    event = AuditEvent.objects.filter(scope_path="acme").first()
    for response in (olivia.post(AUDIT, {}), olivia.patch(f"{AUDIT}{event.public_id}/", {"action": "x"}),
                     olivia.delete(f"{AUDIT}{event.public_id}/")):
        assert response.status_code == 405
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_audit_filters_by_actor_action_scope_and_time(personas, api, history):
    olivia = api(personas.olivia)
    assert actions(olivia.get(AUDIT, {"actor": "max"})) == ["credential.create", "client.create"]
    assert actions(olivia.get(AUDIT, {"actor": "user:olivia"})) == ["contract.set", "scope.rename"]
    assert actions(olivia.get(AUDIT, {"action": "credential"})) == ["credential.create"]
    assert actions(olivia.get(AUDIT, {"action": "scope.rename"})) == ["scope.rename"]
    assert actions(olivia.get(AUDIT, {"scope": "team:acme/ml"})) == ["credential.create", "client.create",
                                                                     "scope.rename"]
    assert actions(olivia.get(AUDIT, {"scope": "project:acme/ml/search", "action": "client"})) == ["client.create"]
    later = (timezone.now() + timedelta(minutes=1)).isoformat()
    assert actions(olivia.get(AUDIT, {"since": later})) == []
    assert len(actions(olivia.get(AUDIT, {"until": later}))) == 4
    bad = olivia.get(AUDIT, {"since": "yesterday-ish"})
    assert bad.status_code == 400 and "since" in bad.json()["error"]["details"]
    hidden = olivia.get(AUDIT, {"scope": "org:globex"})
    assert hidden.status_code == 404


def test_export_streams_json_lines_oldest_first_within_the_callers_reach(personas, api, history):
    response = api(personas.olivia).get(AUDIT + "export/", {"action": "scope"}, HTTP_ACCEPT="application/x-ndjson")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    lines = b"".join(response.streaming_content).decode().splitlines()
    events = [json.loads(line) for line in lines]
    assert [(e["action"], e["scope"]) for e in events] == [("scope.rename", "acme/ml")]
    everything = b"".join(api(personas.olivia).get(AUDIT + "export/").streaming_content).decode().splitlines()
    assert [json.loads(line)["action"] for line in everything] == ["scope.rename", "client.create",
                                                                   "credential.create", "contract.set"]


def test_export_refuses_an_anonymous_caller(personas, api):
    response = api().get(AUDIT + "export/")
    assert response.status_code == 401


def test_no_audit_event_holds_a_key(personas, api, management_key):
    robot = management_key()
    rotated = api(personas.olivia).post(f"/api/tenancy/credentials/{robot.credential.public_id}/rotate/",
                                        {"overlap_hours": 0}).json()
    exported = b"".join(api(personas.olivia).get(AUDIT + "export/").streaming_content).decode()
    for plaintext in (robot.key, rotated["key"]):
        assert plaintext.split("_", 2)[2] not in exported
    assert "credential.rotate" in exported
