"""A held model's placement as a person changes it, on its card and through the API: always running
(min), at most under load (max), capacity class (automatic when unset), idle timeout, pinned and owner.
Every refusal names its field; a refused form comes back as it was typed."""

from __future__ import annotations

import pytest

from serving.catalog import entries, validation
from serving.models import ModelEntry
from tenancy.audit import Actor
from tenancy.models import AuditEvent, Membership, Role
from tests.assets.hub_server import mirror_root  # noqa: F401  (fixture)
from tests.serving.test_catalog_entries import whole
from tests.serving.test_catalog_room import held, per_replica, run_replica, two_fit  # noqa: F401  (fixtures)

ADMIN = Actor(system="tests")
pytestmark = pytest.mark.django_db


def card(held):
    return f"/models/held/{held.public_id}/"


def api(held):
    return f"/api/serving/catalog/models/{held.public_id}/"


def patch(client, held, body):
    return client.patch(api(held), body, content_type="application/json")


@pytest.fixture
def owned(mirror_root, tiny_model, personas):
    """A model of project acme/ml/search (max is a member above it, vera a viewer of it)."""
    return entries.import_local(ADMIN, tiny_model, name="tiny-owned", owner=personas.acme.project)


# --- the class: automatic unless set ---------------------------------------------------------------

def test_a_new_entry_is_automatic_and_the_card_says_what_automatic_is_now(client, admin_user, held):
    assert validation.problems_of(whole(service_class="")) == []
    assert held.service_class == "" and held.effective_class == "opportunistic"  # on demand
    client.force_login(admin_user)
    page = client.get(card(held)).content.decode()
    assert '<option value="" selected>Automatic (opportunistic when on demand, else standard)</option>' in page
    assert "Automatic is opportunistic now (on demand)" in page
    assert 'placeholder="900 (default)"' in page
    held.scaling_min = 1
    assert held.effective_class == "standard"


def test_the_card_saves_class_idle_timeout_and_the_range_and_records_what_changed(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    saved = client.post(card(held), {"scaling_min": "1", "scaling_max": "2", "service_class": "critical",
                                     "idle_timeout_seconds": "120", "owner": ""}, follow=True)
    assert b"at least 1, at most 2 replicas, class critical, idle timeout 120 s, not pinned, owner shared" in saved.content
    held.refresh_from_db()
    assert (held.scaling_min, held.scaling_max) == (1, 2)
    assert (held.service_class, held.idle_timeout_seconds) == ("critical", 120)
    event = AuditEvent.objects.get(action="catalog.model.placement")
    assert event.details["changes"]["service_class"] == {"from": "", "to": "critical"}
    assert event.details["changes"]["idle_timeout_seconds"] == {"from": None, "to": 120}
    # Blank: back to the default timeout; an empty class: automatic again (standard, as one always runs).
    client.post(card(held), {"scaling_min": "1", "scaling_max": "2", "service_class": "", "idle_timeout_seconds": "",
                             "owner": ""})
    held.refresh_from_db()
    assert (held.service_class, held.idle_timeout_seconds, held.effective_class) == ("", None, "standard")
    page = client.get(card(held)).content.decode()
    assert "Automatic is standard now (always running)" in page


def test_an_unknown_class_is_refused_naming_the_field_and_the_form_keeps_what_was_typed(client, admin_user, held):
    client.force_login(admin_user)
    refused = client.post(card(held), {"scaling_min": "0", "scaling_max": "3", "service_class": "vip",
                                       "idle_timeout_seconds": "45"})
    assert refused.status_code == 400
    page = refused.content.decode()
    assert 'data-field="service_class"' in page and "Capacity class: One of critical, standard, opportunistic" in page
    assert 'name="scaling_max" min="0" value="3"' in page and 'value="45"' in page  # nothing typed is lost
    held.refresh_from_db()
    assert (held.service_class, held.scaling_max, held.idle_timeout_seconds) == ("", 1, None)


@pytest.mark.parametrize("typed", ["0", "-5", "soon"])
def test_an_idle_timeout_that_is_not_a_positive_number_of_seconds_is_refused(client, admin_user, held, typed):
    client.force_login(admin_user)
    refused = client.post(card(held), {"scaling_min": "0", "scaling_max": "1", "idle_timeout_seconds": typed})
    assert refused.status_code == 400
    page = refused.content.decode()
    assert "Idle timeout: Seconds, at least 1" in page and "or empty for the default (900 s)" in page
    assert f'value="{typed}"' in page
    held.refresh_from_db()
    assert held.idle_timeout_seconds is None


def test_every_problem_of_one_post_is_named_at_once(client, admin_user, held):
    client.force_login(admin_user)
    page = client.post(card(held), {"scaling_min": "two", "scaling_max": "1", "service_class": "vip",
                                    "idle_timeout_seconds": "0"}).content.decode()
    for field in ("scaling_min", "service_class", "idle_timeout_seconds"):
        assert f'data-field="{field}"' in page
    assert "Always running: A whole number, 0 or more (not &#x27;two&#x27;)" in page


# --- the owner: the right on both scopes ------------------------------------------------------------

def test_a_member_changes_the_placement_and_may_give_the_model_only_where_they_are_member(client, owned, personas):
    client.force_login(personas.max)
    page = client.get(card(owned)).content.decode()
    assert "project:acme/ml/search" in page and "team:acme/ml" in page and "globex" not in page
    assert "Shared (everyone)" not in page  # only administrators share a model
    moved = client.post(card(owned), {"scaling_min": "0", "scaling_max": "2", "service_class": "standard",
                                      "owner": str(personas.acme.team.public_id)}, follow=True)
    assert b"owner team:acme/ml" in moved.content
    owned.refresh_from_db()
    assert (owned.owner, owned.scaling_max, owned.service_class) == (personas.acme.team, 2, "standard")
    event = AuditEvent.objects.get(action="catalog.model.placement")
    assert event.scope == personas.acme.project  # the scope it left sees it go
    assert event.details["changes"]["owner"] == {"from": "project:acme/ml/search", "to": "team:acme/ml"}


def test_a_scope_outside_the_callers_reach_is_refused_as_the_owner(client, owned, personas):
    client.force_login(personas.max)
    refused = client.post(card(owned), {"scaling_min": "0", "scaling_max": "1",
                                        "owner": str(personas.globex.project.public_id)})
    assert refused.status_code == 404 and b'data-field="owner"' in refused.content
    assert b"outside your reach" in refused.content
    owned.refresh_from_db()
    assert owned.owner == personas.acme.project


def test_giving_a_model_to_a_scope_where_the_caller_only_views_is_refused(client, owned, personas, tiny_model):
    # vera is a member of globex's search project and a viewer of acme's.
    Membership.objects.create(user=personas.vera, scope=personas.globex.project, role=Role.MEMBER)
    theirs = entries.import_local(ADMIN, tiny_model, name="tiny-globex", owner=personas.globex.project)
    client.force_login(personas.vera)
    refused = client.post(card(theirs), {"scaling_min": "0", "scaling_max": "1",
                                         "owner": str(personas.acme.project.public_id)})
    assert refused.status_code == 403
    assert b"Owner: Your role does not allow giving tiny-globex to project:acme/ml/search" in refused.content
    theirs.refresh_from_db()
    assert theirs.owner == personas.globex.project
    # And the other way: the old scope needs the right too (vera only views acme's model).
    page = client.get(card(owned)).content.decode()
    assert "<fieldset disabled>" in page and "Changing it takes member (or above) of project:acme/ml/search" in page
    refused = client.post(card(owned), {"scaling_min": "0", "scaling_max": "1",
                                        "owner": str(personas.globex.project.public_id)})
    assert refused.status_code == 403 and b"Your role does not allow changing tiny-owned" in refused.content
    owned.refresh_from_db()
    assert owned.owner == personas.acme.project


def test_only_an_administrator_makes_a_model_shared(client, admin_user, owned, personas):
    client.force_login(personas.olivia)  # owns the organisation, yet is no administrator of Berth
    refused = client.post(card(owned), {"scaling_min": "0", "scaling_max": "1", "owner": ""})
    assert refused.status_code == 403 and b"Owner: Only administrators make tiny-owned shared" in refused.content
    client.force_login(admin_user)
    assert b"Shared (everyone)" in client.get(card(owned)).content
    client.post(card(owned), {"scaling_min": "0", "scaling_max": "1", "owner": ""})
    owned.refresh_from_db()
    assert owned.owner is None


# --- the API: the same rules ------------------------------------------------------------------------

def test_api_patch_sets_and_returns_the_automatic_class(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    answer = patch(client, held, {"service_class": "critical", "scaling_min": 1, "scaling_max": 2,
                                  "idle_timeout_seconds": 300})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["service_class"], body["effective_class"]) == ("critical", "critical")
    assert body["idle_timeout_seconds"] == 300
    body = patch(client, held, {"service_class": "", "idle_timeout_seconds": None}).json()
    assert (body["service_class"], body["effective_class"], body["idle_timeout_seconds"]) == ("", "standard", None)
    assert (body["scaling_min"], body["scaling_max"]) == (1, 2)  # left out: unchanged
    assert client.get(api(held)).json()["service_class"] == ""


def test_api_patch_refuses_what_the_card_refuses_naming_the_field(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    unknown = patch(client, held, {"service_class": "vip"})
    assert unknown.status_code == 400 and "service_class" in unknown.json()["error"]["details"]
    below = patch(client, held, {"scaling_min": 2, "scaling_max": 1}).json()["error"]
    assert below["code"] == "invalid_model_entry"
    assert [p["field"] for p in below["details"]["problems"]] == ["scaling_max"]
    idle = patch(client, held, {"idle_timeout_seconds": 0}).json()["error"]
    assert idle["code"] == "invalid_model_entry" and idle["details"]["problems"][0]["field"] == "idle_timeout_seconds"
    unmeetable = patch(client, held, {"scaling_min": 3, "scaling_max": 3})
    assert unmeetable.status_code == 409
    error = unmeetable.json()["error"]
    assert error["code"] == "scaling_refused" and "at least 3 cannot be met" in error["message"]
    assert error["details"]["problems"][0]["field"] == "scaling_min" and error["details"]["more"] == 2
    renamed = patch(client, held, {"name": "other"})
    assert renamed.status_code == 400 and "name" in renamed.json()["error"]["details"]
    assert client.put(api(held), {}, content_type="application/json").status_code == 405
    held.refresh_from_db()
    assert (held.name, held.scaling_min, held.scaling_max, held.service_class, held.idle_timeout_seconds) == \
        ("tiny-held", 0, 1, "", None)


def test_api_patch_counts_what_runs_toward_a_raised_minimum(client, admin_user, held, two_fit, per_replica):
    from scheduler.models import MemoryReservation

    run_replica(held, two_fit)
    MemoryReservation.objects.create(node=two_fit, holder="replica:1", bytes=per_replica)
    client.force_login(admin_user)
    refused = patch(client, held, {"scaling_min": 3, "scaling_max": 3})
    assert refused.status_code == 409 and refused.json()["error"]["details"]["running"] == 1
    assert patch(client, held, {"scaling_min": 2, "scaling_max": 2}).status_code == 200  # one runs, one more fits


def test_api_patch_checks_the_owner_on_both_sides(client, admin_user, owned, personas):
    client.force_login(personas.vera)  # a viewer of acme/ml/search
    viewer = patch(client, owned, {"scaling_max": 2})
    assert viewer.status_code == 403 and viewer.json()["error"]["code"] == "permission_denied"
    client.force_login(personas.max)
    outside = patch(client, owned, {"owner": "project:globex/ml/search"})
    assert outside.status_code == 404 and outside.json()["error"]["details"]["problems"][0]["field"] == "owner"
    shared = patch(client, owned, {"owner": None})
    assert shared.status_code == 403 and shared.json()["error"]["details"]["problems"][0]["field"] == "owner"
    moved = patch(client, owned, {"owner": "acme/ml"})  # the path, as the API shows it, is understood
    assert moved.status_code == 200 and moved.json()["owner"] == "acme/ml"
    client.force_login(personas.vera)
    assert patch(client, owned, {"scaling_max": 2}).status_code == 404  # acme/ml is outside her reach
    owned.refresh_from_db()
    assert owned.owner == personas.acme.team
    client.force_login(admin_user)
    assert patch(client, owned, {"owner": ""}).json()["owner"] is None
    assert ModelEntry.objects.get(pk=owned.pk).owner is None


# --- pinned: always resident ------------------------------------------------------------------------

def test_the_card_pins_and_unpins_a_model_and_records_it(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    assert 'name="pinned" value="on">' in client.get(card(held)).content.decode()  # not checked
    form = {"scaling_min": "0", "scaling_max": "1", "service_class": "", "idle_timeout_seconds": "", "owner": ""}
    saved = client.post(card(held), {**form, "pinned": ["off", "on"]}, follow=True)  # the hidden off, then the box
    assert b"idle timeout the default, pinned, owner shared" in saved.content
    held.refresh_from_db()
    assert held.pinned
    assert AuditEvent.objects.get(action="catalog.model.placement").details["changes"]["pinned"] == \
        {"from": False, "to": True}
    assert 'name="pinned" value="on" checked>' in client.get(card(held)).content.decode()
    client.post(card(held), {**form, "pinned": "off"})  # unchecked: only the hidden field is sent
    held.refresh_from_db()
    assert not held.pinned


def test_api_patch_pins_and_refuses_what_is_not_true_or_false(client, admin_user, held, two_fit):
    client.force_login(admin_user)
    body = patch(client, held, {"pinned": True}).json()
    assert body["pinned"] is True and (body["scaling_min"], body["scaling_max"]) == (0, 1)
    refused = patch(client, held, {"pinned": "sometimes"})
    assert refused.status_code == 400 and "pinned" in refused.json()["error"]["details"]
    assert patch(client, held, {"pinned": False}).json()["pinned"] is False


def test_a_pin_placement_cannot_meet_is_refused_naming_the_field(client, admin_user, held):
    client.force_login(admin_user)  # no node: nothing fits anywhere
    refused = patch(client, held, {"pinned": True})
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "scaling_refused" and error["details"]["problems"][0]["field"] == "pinned"
    held.refresh_from_db()
    assert not held.pinned


# --- fallbacks and the draft: models the catalog holds ------------------------------------------

@pytest.fixture
def small(mirror_root, tiny_model, tmp_path):
    """A second catalog model (the same tiny GGUF: the same vocabulary, as a draft needs)."""
    import shutil

    return entries.import_local(ADMIN, shutil.copy(tiny_model, tmp_path / "small.gguf"), name="tiny-small")


def test_fallbacks_and_a_draft_are_set_on_the_card_and_by_the_api(client, admin_user, held, small, two_fit):
    client.force_login(admin_user)
    form = {"scaling_min": "0", "scaling_max": "1", "service_class": "", "idle_timeout_seconds": "", "owner": "",
            "fallbacks": " tiny-small , ", "draft": "tiny-small"}
    saved = client.post(card(held), form, follow=True)
    assert b"falls back to tiny-small, drafted by tiny-small" in saved.content
    held.refresh_from_db()
    assert (held.fallbacks, held.draft) == (["tiny-small"], "tiny-small")
    changes = AuditEvent.objects.get(action="catalog.model.placement").details["changes"]
    assert changes["fallbacks"] == {"from": [], "to": ["tiny-small"]} and changes["draft"]["to"] == "tiny-small"
    page = client.get(card(held)).content.decode()
    assert 'name="fallbacks" value="tiny-small"' in page and 'name="draft" value="tiny-small"' in page
    body = patch(client, held, {"fallbacks": [], "draft": ""}).json()
    assert (body["fallbacks"], body["draft"]) == ([], "")


def test_a_draft_changes_the_fingerprint_and_fallbacks_do_not(admin_user, held, small):
    from serving.catalog import placing

    before = held.fingerprint
    held = placing.change(ADMIN, held, {"fallbacks": ["tiny-small"]})
    assert held.fingerprint == before  # what stands in for it is not what it is
    held = placing.change(ADMIN, held, {"draft": "tiny-small"})
    assert held.fingerprint != before  # what runs in its engine is


def test_names_the_catalog_does_not_hold_are_refused_naming_the_field(client, admin_user, held, small):
    client.force_login(admin_user)
    refused = patch(client, held, {"fallbacks": ["tiny-small", "no-such-model"], "draft": "nor-this"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_model_entry"
    assert {(p["field"], p["message"]) for p in error["details"]["problems"]} == {
        ("fallbacks", "No model named no-such-model in the catalog."), ("draft", "No model named nor-this in the catalog.")}
    itself = patch(client, held, {"draft": "tiny-held"}).json()["error"]
    assert itself["details"]["problems"] == [{"field": "draft", "message": "A model cannot draft for itself."}]
    page = client.post(card(held), {"fallbacks": "tiny-held", "owner": ""}).content.decode()
    assert "A model cannot fall back to itself." in page and 'data-field="fallbacks"' in page
    held.refresh_from_db()
    assert (held.fallbacks, held.draft) == ([], "")

