"""Service clients and their keys through the management API: who may manage them, and a key's
whole life — shown once, used as a management key, revoked, rotated with overlap."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from tenancy.models import AuditEvent, Credential, ServiceClient

pytestmark = pytest.mark.django_db

CLIENTS = "/api/tenancy/clients/"
KEYS = "/api/tenancy/credentials/"
PROBE = "/api/tenancy/scopes/"  # any management endpoint


def bearer(key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def error_code(response) -> str:
    return response.json()["error"]["code"]


def new_client(api, user, **fields) -> dict:
    # Inference by default: a member may make those; management access takes an admin (test_hardening).
    body = {"project": "project:acme/ml/search", "name": "search-bot", "access": "inference"} | fields
    response = api(user).post(CLIENTS, body)
    assert response.status_code == 201, response.content
    return response.json()


def new_key(api, user, client_id, **fields) -> dict:
    response = api(user).post(KEYS, {"client": client_id, "name": "ci"} | fields)
    assert response.status_code == 201, response.content
    return response.json()


# --- clients ----------------------------------------------------------------------------------------

def test_member_creates_and_updates_a_client_of_his_project(personas, api):
    created = new_client(api, personas.max, allowed_models=["qwen3-8b"], rpm_limit=600, priority="high")
    assert created["project_written"] == "project:acme/ml/search"
    assert created["allowed_models"] == ["qwen3-8b"] and created["rpm_limit"] == 600
    updated = api(personas.max).patch(f"{CLIENTS}{created['id']}/", {"rpm_limit": None, "all_models": True})
    assert updated.status_code == 200
    assert updated.json()["rpm_limit"] is None and updated.json()["all_models"] is True


def test_viewer_sees_clients_but_cannot_create_change_or_delete_them(personas, api):
    created = new_client(api, personas.olivia)
    vera = api(personas.vera)
    assert [row["id"] for row in vera.get(CLIENTS).json()["results"]] == [created["id"]]
    assert vera.post(CLIENTS, {"project": "project:acme/ml/search", "name": "mine"}).status_code == 403
    assert vera.patch(f"{CLIENTS}{created['id']}/", {"is_active": False}).status_code == 403
    assert vera.delete(f"{CLIENTS}{created['id']}/").status_code == 403
    assert vera.post(KEYS, {"client": created["id"]}).status_code == 403


def test_outsider_gets_404_for_another_orgs_client_and_its_keys(personas, api):
    created = new_client(api, personas.olivia)
    key = new_key(api, personas.olivia, created["id"])
    oscar = api(personas.oscar)
    client_url, key_url = f"{CLIENTS}{created['id']}/", f"{KEYS}{key['id']}/"
    responses = [oscar.get(client_url), oscar.patch(client_url, {"is_active": False}), oscar.delete(client_url),
                 oscar.post(KEYS, {"client": created["id"]}), oscar.get(key_url),
                 oscar.post(key_url + "revoke/"), oscar.post(key_url + "rotate/", {"overlap_hours": 1})]
    assert [r.status_code for r in responses] == [404] * len(responses)
    assert oscar.get(CLIENTS).json()["results"] == [] and oscar.get(KEYS).json()["results"] == []
    spy = oscar.post(CLIENTS, {"project": "project:acme/ml/search", "name": "spy"})
    assert spy.status_code == 404
    assert ServiceClient.objects.filter(name="spy").count() == 0
    assert Credential.objects.get(public_id=key["id"]).revoked_at is None


def test_client_needs_a_project_and_valid_fields(personas, api):
    olivia = api(personas.olivia)
    not_project = olivia.post(CLIENTS, {"project": "team:acme/ml", "name": "x"})
    assert (not_project.status_code, error_code(not_project)) == (400, "invalid_tree")
    bad = olivia.post(CLIENTS, {"project": "project:acme/ml/search", "name": "x", "environment": "moon",
                                "rpm_limit": 0})
    assert (bad.status_code, error_code(bad)) == (400, "invalid")
    assert set(bad.json()["error"]["details"]) == {"environment", "rpm_limit"}
    new_client(api, personas.olivia)
    twice = olivia.post(CLIENTS, {"project": "project:acme/ml/search", "name": "search-bot"})
    assert (twice.status_code, error_code(twice)) == (409, "already_exists")


def test_a_clients_project_and_name_cannot_be_changed_and_say_so(personas, api):
    created = new_client(api, personas.max)
    response = api(personas.max).patch(f"{CLIENTS}{created['id']}/", {"project": "project:globex/ml/search",
                                                                      "name": "renamed"})
    assert (response.status_code, error_code(response)) == (400, "invalid")
    assert set(response.json()["error"]["details"]) == {"project", "name"}


def test_deleting_a_client_ends_its_keys(personas, api):
    created = new_client(api, personas.max)
    key = new_key(api, personas.max, created["id"])
    assert api(personas.max).delete(f"{CLIENTS}{created['id']}/").status_code == 204
    assert error_code(api().get(PROBE, **bearer(key["key"]))) == "invalid_api_key"


# --- keys -------------------------------------------------------------------------------------------

def test_key_plaintext_is_shown_once_and_never_listed(personas, api):
    created = new_client(api, personas.max)
    key = new_key(api, personas.max, created["id"], lifetime_days=30)
    assert key["key"].startswith(key["prefix"] + "_") and key["prefix"].startswith("brk_")
    assert key["state"] == "active" and key["lifetime_days"] == 30 and key["created_by"] == "max"
    secret = key["key"].split("_", 2)[2]
    olivia = api(personas.olivia)
    for response in (olivia.get(KEYS), olivia.get(f"{KEYS}{key['id']}/"), olivia.get(f"{CLIENTS}{created['id']}/")):
        assert response.status_code == 200
        assert secret not in response.content.decode()
        assert "key" not in response.json() and all("key" not in row for row in response.json().get("results", []))


def test_management_key_works_on_the_api_as_admin_of_its_project(personas, api):
    created = new_client(api, personas.olivia, access="management")
    key = new_key(api, personas.olivia, created["id"])
    response = api().get(PROBE, **bearer(key["key"]))
    assert response.status_code == 200
    assert [row["path"] for row in response.json()["results"]] == ["acme/ml/search"]
    # It acts as itself: the audit log names the client, not a person.
    renamed = api().patch(f"{PROBE}{personas.acme.project.public_id}/", {"name": "Search v2"}, format="json",
                          **bearer(key["key"]))
    assert renamed.status_code == 200
    assert AuditEvent.objects.filter(action="scope.rename").get().actor == "client:acme/ml/search/search-bot"
    # ... and cannot reach beyond its project.
    assert api().get(f"{PROBE}{personas.acme.team.public_id}/", **bearer(key["key"])).status_code == 404


def test_revoked_key_is_refused_with_401_api_key_revoked(personas, api):
    created = new_client(api, personas.max)
    key = new_key(api, personas.max, created["id"])
    revoked = api(personas.max).post(f"{KEYS}{key['id']}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    response = api().get(PROBE, **bearer(key["key"]))
    assert (response.status_code, error_code(response)) == (401, "api_key_revoked")


def test_rotated_keys_both_work_inside_the_overlap_and_only_the_new_after(personas, api):
    created = new_client(api, personas.olivia, access="management")
    old = new_key(api, personas.olivia, created["id"], lifetime_days=90)
    rotated = api(personas.olivia).post(f"{KEYS}{old['id']}/rotate/", {"overlap_hours": 2})
    assert rotated.status_code == 201, rotated.content
    new = rotated.json()
    assert new["replaces"] == old["id"] and new["key"] != old["key"] and new["lifetime_days"] == 90
    old_row = Credential.objects.get(public_id=old["id"])
    assert timedelta(hours=1) < old_row.expires_at - timezone.now() <= timedelta(hours=2)
    assert api().get(PROBE, **bearer(old["key"])).status_code == 200
    assert api().get(PROBE, **bearer(new["key"])).status_code == 200
    # The end of the overlap window: the old key's real expiry now lies in the past.
    Credential.objects.filter(pk=old_row.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    expired = api().get(PROBE, **bearer(old["key"]))
    assert (expired.status_code, error_code(expired)) == (401, "api_key_expired")
    assert api().get(PROBE, **bearer(new["key"])).status_code == 200
    twice = api(personas.olivia).post(f"{KEYS}{old['id']}/rotate/", {})
    assert twice.status_code in (400, 409)


def test_rotation_overlap_is_validated(personas, api):
    created = new_client(api, personas.max)
    key = new_key(api, personas.max, created["id"])
    response = api(personas.max).post(f"{KEYS}{key['id']}/rotate/", {"overlap_hours": -1})
    assert (response.status_code, error_code(response)) == (400, "invalid")
    assert "overlap_hours" in response.json()["error"]["details"]


def test_wrong_key_is_refused_with_401_invalid_api_key(personas, api):
    created = new_client(api, personas.max)
    key = new_key(api, personas.max, created["id"])
    wrong = key["prefix"] + "_" + "A" * 43
    response = api().get(PROBE, **bearer(wrong))
    assert (response.status_code, error_code(response)) == (401, "invalid_api_key")
    unknown = api().get(PROBE, **bearer("brk_000000000000_" + "B" * 43))
    assert (unknown.status_code, error_code(unknown)) == (401, "invalid_api_key")


@pytest.mark.parametrize("header", ["Token abc", "Bearer", "Bearer   ", "brk_abc"])
def test_malformed_authorization_header_is_refused_with_401(personas, api, header):
    response = api().get(PROBE, HTTP_AUTHORIZATION=header)
    assert (response.status_code, error_code(response)) == (401, "malformed_authorization")


def test_inference_only_key_is_refused_on_the_management_api(personas, api):
    created = new_client(api, personas.max, access="inference")
    key = new_key(api, personas.max, created["id"])
    response = api().get(PROBE, **bearer(key["key"]))
    assert (response.status_code, error_code(response)) == (403, "permission_denied")


def test_key_of_a_disabled_client_is_refused(personas, api):
    created = new_client(api, personas.max)
    key = new_key(api, personas.max, created["id"])
    assert api(personas.max).patch(f"{CLIENTS}{created['id']}/", {"is_active": False}).status_code == 200
    response = api().get(PROBE, **bearer(key["key"]))
    assert (response.status_code, error_code(response)) == (403, "client_disabled")


def test_key_filters_select_by_client_and_state(personas, api):
    created = new_client(api, personas.max)
    kept = new_key(api, personas.max, created["id"])
    dropped = new_key(api, personas.max, created["id"])
    api(personas.max).post(f"{KEYS}{dropped['id']}/revoke/")
    maxi = api(personas.max)
    assert [r["id"] for r in maxi.get(KEYS, {"state": "active"}).json()["results"]] == [kept["id"]]
    assert [r["id"] for r in maxi.get(KEYS, {"state": "revoked"}).json()["results"]] == [dropped["id"]]
    assert len(maxi.get(KEYS, {"client": created["id"]}).json()["results"]) == 2


def test_key_changes_leave_one_event_each_and_no_event_holds_a_plaintext(personas, api):
    created = new_client(api, personas.max)
    before = AuditEvent.objects.count()
    key = new_key(api, personas.max, created["id"])
    rotated = api(personas.max).post(f"{KEYS}{key['id']}/rotate/", {"overlap_hours": 1}).json()
    api(personas.max).post(f"{KEYS}{rotated['id']}/revoke/")
    api(personas.max).post(f"{KEYS}{rotated['id']}/revoke/")  # already revoked: no change, no event
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True)[before:])
    assert actions == ["credential.create", "credential.rotate", "credential.revoke"]
    everything = json.dumps(list(AuditEvent.objects.values("details", "object_repr")))
    for plaintext in (key["key"], rotated["key"]):
        assert plaintext not in everything and plaintext.split("_", 2)[2] not in everything
