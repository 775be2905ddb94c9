"""The tree and memberships through the management API, for each persona."""

import pytest

from tenancy.models import AuditEvent, Membership, Scope
from tenancy.services import contracts

pytestmark = pytest.mark.django_db

SCOPES = "/api/tenancy/scopes/"
MEMBERSHIPS = "/api/tenancy/memberships/"


def paths(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["path"] for row in response.json()["results"]]


def test_each_persona_lists_only_the_scopes_within_their_reach(personas, api):
    assert paths(api(personas.olivia).get(SCOPES)) == ["acme", "acme/ml", "acme/ml/search"]
    assert paths(api(personas.max).get(SCOPES)) == ["acme/ml", "acme/ml/search"]
    assert paths(api(personas.vera).get(SCOPES)) == ["acme/ml/search"]
    assert paths(api(personas.oscar).get(SCOPES)) == ["globex", "globex/ml", "globex/ml/search"]


def test_anonymous_caller_is_refused(personas, api):
    response = api().get(SCOPES)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"


def test_a_scope_shows_its_written_form_parent_and_holdings_summed_below(personas, api):
    contracts.reserve(personas.acme.project, "replica:1", gpu_memory_gib=10, gpus=1)
    body = api(personas.olivia).get(f"{SCOPES}{personas.acme.team.public_id}/").json()
    assert body["written"] == "team:acme/ml"
    assert body["parent"] == str(personas.acme.org.public_id)
    assert body["holdings"] == {"gpu_memory_gib": "10.00", "gpus": "1.00", "cores": "0.00"}
    listed = {row["path"]: row for row in api(personas.olivia).get(SCOPES).json()["results"]}
    assert listed["acme"]["holdings"]["gpu_memory_gib"] == "10.00"
    assert listed["acme"]["parent"] is None


def test_outsider_gets_404_for_another_orgs_scope_on_every_verb(personas, api):
    oscar = api(personas.oscar)
    url = f"{SCOPES}{personas.acme.team.public_id}/"
    for response in (oscar.get(url), oscar.patch(url, {"name": "Mine"}), oscar.delete(url)):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert Scope.objects.get(pk=personas.acme.team.pk).name == "ML"


def test_outsider_cannot_create_under_another_orgs_scope_and_learns_nothing(personas, api):
    response = api(personas.oscar).post(SCOPES, {"kind": "project", "slug": "spy", "parent": "team:acme/ml"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "scope_not_found"
    assert not Scope.objects.filter(slug="spy").exists()


def test_owner_creates_a_team_written_or_by_id(personas, api):
    olivia = api(personas.olivia)
    response = olivia.post(SCOPES, {"kind": "team", "slug": "Data ", "name": "Data", "parent": "org:acme"})
    assert response.status_code == 201, response.content
    assert response.json()["written"] == "team:acme/data"
    by_id = olivia.post(SCOPES, {"kind": "project", "slug": "etl", "parent": response.json()["id"]})
    assert by_id.status_code == 201
    assert by_id.json()["path"] == "acme/data/etl"


def test_member_cannot_create_child_scopes(personas, api):
    response = api(personas.max).post(SCOPES, {"kind": "project", "slug": "side", "parent": "team:acme/ml"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


def test_only_an_administrator_of_berth_creates_organisations(personas, api, admin_user):
    assert api(personas.olivia).post(SCOPES, {"kind": "org", "slug": "initech"}).status_code == 403
    response = api(admin_user).post(SCOPES, {"kind": "org", "slug": "initech", "name": "Initech"})
    assert response.status_code == 201
    assert response.json()["parent"] is None


def test_invalid_scope_input_is_refused_with_stable_codes(personas, api):
    olivia = api(personas.olivia)
    cases = [({"kind": "galaxy", "slug": "x", "parent": "org:acme"}, "invalid"),
             ({"kind": "team", "slug": "-bad-", "parent": "org:acme"}, "invalid_tree"),
             ({"kind": "project", "slug": "x", "parent": "org:acme"}, "invalid_tree"),
             ({"kind": "team", "slug": "x", "parent": "planet:acme"}, "unknown_scope_kind"),
             ({"kind": "team", "slug": "ml", "parent": "org:acme"}, "already_exists")]
    for body, code in cases:
        response = olivia.post(SCOPES, body)
        assert response.json()["error"]["code"] == code, (body, response.content)
        assert response.status_code in (400, 409)


def test_viewer_cannot_rename_and_owner_can(personas, api):
    url = f"{SCOPES}{personas.acme.project.public_id}/"
    refused = api(personas.vera).patch(url, {"name": "Renamed"})
    assert refused.status_code == 403
    renamed = api(personas.olivia).patch(url, {"name": "Renamed"})
    assert renamed.status_code == 200
    assert renamed.json()["name"] == "Renamed"


def test_member_cannot_delete_and_owner_deletes_only_an_empty_scope(personas, api):
    assert api(personas.max).delete(f"{SCOPES}{personas.acme.project.public_id}/").status_code == 403
    busy = api(personas.olivia).delete(f"{SCOPES}{personas.acme.team.public_id}/")
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "in_use"
    assert busy.json()["error"]["details"] == {"children": 1}
    gone = api(personas.olivia).delete(f"{SCOPES}{personas.acme.project.public_id}/")
    assert gone.status_code == 204
    assert not Scope.objects.filter(pk=personas.acme.project.pk).exists()


def test_resolve_reads_a_written_scope_among_those_the_caller_sees(personas, api, admin_user):
    found = api(personas.max).get(SCOPES + "resolve/", {"scope": " Team:ACME/ml "})
    assert found.status_code == 200
    assert found.json()["id"] == str(personas.acme.team.public_id)
    # "team:ml" is ambiguous to someone who sees both organisations, not to olivia.
    assert api(personas.olivia).get(SCOPES + "resolve/", {"scope": "team:ml"}).json()["path"] == "acme/ml"
    ambiguous = api(admin_user).get(SCOPES + "resolve/", {"scope": "team:ml"})
    assert ambiguous.status_code == 400
    assert ambiguous.json()["error"]["details"]["candidates"] == ["team:acme/ml", "team:globex/ml"]
    hidden = api(personas.oscar).get(SCOPES + "resolve/", {"scope": "team:acme/ml"})
    assert hidden.status_code == 404
    assert hidden.json()["error"]["code"] == "scope_not_found"


def test_scope_filters_narrow_the_list(personas, api):
    olivia = api(personas.olivia)
    assert paths(olivia.get(SCOPES, {"kind": "project"})) == ["acme/ml/search"]
    assert paths(olivia.get(SCOPES, {"within": "team:acme/ml"})) == ["acme/ml", "acme/ml/search"]
    assert paths(olivia.get(SCOPES, {"parent": "org:acme"})) == ["acme/ml"]
    assert olivia.get(SCOPES, {"kind": "galaxy"}).json()["error"]["code"] == "invalid"


# --- memberships ------------------------------------------------------------------------------------

def test_owner_adds_changes_and_removes_a_membership(personas, api, django_user_model):
    django_user_model.objects.create_user("nina", "nina@example.org", "a-long-test-password")
    olivia = api(personas.olivia)
    added = olivia.post(MEMBERSHIPS, {"username": "nina", "scope": "team:acme/ml", "role": "member"})
    assert added.status_code == 201, added.content
    assert added.json()["scope_written"] == "team:acme/ml"
    url = f"{MEMBERSHIPS}{added.json()['id']}/"
    changed = olivia.patch(url, {"role": "admin"})
    assert changed.status_code == 200
    assert changed.json()["role"] == "admin"
    assert olivia.delete(url).status_code == 204
    assert not Membership.objects.filter(user__username="nina").exists()


def test_member_cannot_grant_or_change_roles(personas, api, django_user_model):
    django_user_model.objects.create_user("nina", "nina@example.org", "a-long-test-password")
    maxi = api(personas.max)
    assert maxi.post(MEMBERSHIPS, {"username": "nina", "scope": "project:acme/ml/search",
                                   "role": "viewer"}).status_code == 403
    vera_membership = Membership.objects.get(user=personas.vera)
    assert maxi.patch(f"{MEMBERSHIPS}{vera_membership.public_id}/", {"role": "owner"}).status_code == 403
    assert maxi.delete(f"{MEMBERSHIPS}{vera_membership.public_id}/").status_code == 403


def test_viewer_sees_memberships_of_her_project_but_cannot_change_them(personas, api):
    vera = api(personas.vera)
    listed = vera.get(MEMBERSHIPS).json()["results"]
    assert [(row["user"], row["scope_written"]) for row in listed] == [("vera", "project:acme/ml/search")]
    own = Membership.objects.get(user=personas.vera)
    assert vera.patch(f"{MEMBERSHIPS}{own.public_id}/", {"role": "owner"}).status_code == 403


def test_outsider_gets_404_for_another_orgs_membership(personas, api):
    membership = Membership.objects.get(user=personas.max)
    oscar = api(personas.oscar)
    url = f"{MEMBERSHIPS}{membership.public_id}/"
    assert [oscar.get(url).status_code, oscar.patch(url, {"role": "viewer"}).status_code,
            oscar.delete(url).status_code] == [404, 404, 404]
    spy = oscar.post(MEMBERSHIPS, {"username": "oscar", "scope": "org:acme", "role": "owner"})
    assert spy.status_code == 404
    assert not Membership.objects.filter(user=personas.oscar, scope=personas.acme.org).exists()


def test_membership_input_is_validated(personas, api):
    olivia = api(personas.olivia)
    unknown_role = olivia.post(MEMBERSHIPS, {"username": "max", "scope": "org:acme", "role": "king"})
    assert unknown_role.status_code == 400
    assert "role" in unknown_role.json()["error"]["details"]
    unknown_user = olivia.post(MEMBERSHIPS, {"username": "nobody", "scope": "org:acme", "role": "viewer"})
    assert unknown_user.status_code == 400
    assert unknown_user.json()["error"]["details"] == {"user": "unknown"}
    twice = olivia.post(MEMBERSHIPS, {"username": "max", "scope": "team:acme/ml", "role": "viewer"})
    assert twice.status_code == 409
    assert twice.json()["error"]["code"] == "already_exists"


def test_each_tree_change_through_the_api_leaves_exactly_one_event(personas, api):
    olivia = api(personas.olivia)
    before = AuditEvent.objects.count()
    created = olivia.post(SCOPES, {"kind": "team", "slug": "data", "parent": "org:acme"}).json()
    olivia.patch(f"{SCOPES}{created['id']}/", {"name": "Data science"})
    olivia.delete(f"{SCOPES}{created['id']}/")
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True)[before:])
    assert actions == ["scope.create", "scope.rename", "scope.delete"]
