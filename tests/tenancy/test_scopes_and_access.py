"""The tree as people write it, and roles that hold for everything below them."""

import pytest

from berth.errors import NotFound
from tenancy import access
from tenancy.audit import Actor
from tenancy.errors import AlreadyExists, AmbiguousScope, Forbidden, InUse, InvalidTree, ScopeNotFound, ScopeSyntax, UnknownScopeKind
from tenancy.models import AuditEvent, Membership, Scope, ServiceClient
from tenancy.services import members, tree

pytestmark = pytest.mark.django_db


def test_scope_resolves_by_id_then_path_then_unique_last_element(personas):
    project = personas.acme.project
    assert tree.resolve_scope(str(project.public_id)) == project
    assert tree.resolve_scope("  PROJECT:Acme/ML/Search/ ") == project
    assert tree.resolve_scope("org:acme") == personas.acme.org
    assert tree.resolve_scope("team:acme/ml") == personas.acme.team
    assert tree.resolve_scope(f"team:{personas.acme.team.public_id}") == personas.acme.team


def test_ambiguous_short_name_is_refused_with_the_candidates(personas):
    with pytest.raises(AmbiguousScope) as refused:
        tree.resolve_scope("project:search")  # acme/ml/search and globex/ml/search
    assert refused.value.details["candidates"] == ["project:acme/ml/search", "project:globex/ml/search"]


def test_unique_short_name_resolves(personas):
    tree.create_scope(Actor(user=personas.olivia), "project", "ranking", parent=personas.acme.team)
    assert tree.resolve_scope("project:ranking").path == "acme/ml/ranking"
    assert tree.resolve_scope("ranking").path == "acme/ml/ranking"  # the kind may be left out
    assert tree.resolve_scope("acme") == personas.acme.org


@pytest.mark.parametrize("written, error", [("cluster:acme", UnknownScopeKind), ("nowhere", ScopeNotFound),
                                            ("", ScopeSyntax), ("org:nowhere", ScopeNotFound)])
def test_malformed_or_unknown_scopes_are_refused(personas, written, error):
    with pytest.raises(error):
        tree.resolve_scope(written)


def test_a_role_holds_for_everything_below_its_scope(personas):
    search = personas.acme.project
    assert access.role_on(personas.olivia, search) == "owner"
    assert access.role_on(personas.max, search) == "member"
    assert access.role_on(personas.max, personas.acme.org) is None
    assert access.role_on(personas.oscar, search) is None


def test_visible_to_narrows_each_persona_to_their_subtree(personas):
    scopes = Scope.objects.all()
    assert {s.path for s in access.visible_to(personas.vera, scopes, "")} == {"acme/ml/search"}
    assert {s.path for s in access.visible_to(personas.max, scopes, "")} == {"acme/ml", "acme/ml/search"}
    assert {s.path for s in access.visible_to(personas.oscar, scopes, "")} == {"globex", "globex/ml", "globex/ml/search"}


def test_outsider_gets_not_found_and_viewer_gets_forbidden(personas):
    search = personas.acme.project
    with pytest.raises(NotFound):
        access.require(personas.oscar, "view", search)
    with pytest.raises(Forbidden):
        access.require(personas.vera, "use", search)
    access.require(personas.max, "use", search)


def test_tree_shape_is_enforced(personas):
    olivia = personas.olivia_actor
    with pytest.raises(InvalidTree):
        tree.create_scope(olivia, "project", "p", parent=personas.acme.org)  # projects belong to teams
    with pytest.raises(InvalidTree):
        tree.create_scope(olivia, "team", "Bad Slug!", parent=personas.acme.org)
    with pytest.raises(AlreadyExists):
        tree.create_scope(olivia, "team", "ml", parent=personas.acme.org)
    with pytest.raises(Forbidden):
        tree.create_scope(olivia, "org", "initech")  # organisations are for Berth's administrators


def test_member_cannot_create_scopes_and_admin_can(personas, django_user_model):
    with pytest.raises(NotFound):  # max cannot even see the organisation above his team
        tree.create_scope(personas.max_actor, "team", "infra", parent=personas.acme.org)
    with pytest.raises(Forbidden):
        tree.create_scope(personas.max_actor, "project", "ranking", parent=personas.acme.team)
    admin = django_user_model.objects.create_user("ada")
    members.add_member(personas.olivia_actor, personas.acme.org, admin, "admin")
    team = tree.create_scope(Actor(user=admin), "team", "infra", parent=personas.acme.org)
    assert team.path == "acme/infra"


def test_only_owners_make_owners(personas, django_user_model):
    newcomer = django_user_model.objects.create_user("nico")
    admin = django_user_model.objects.create_user("ada")
    members.add_member(personas.olivia_actor, personas.acme.org, admin, "admin")
    with pytest.raises(Forbidden):
        members.add_member(Actor(user=admin), personas.acme.team, newcomer, "owner")
    members.add_member(Actor(user=admin), personas.acme.team, newcomer, "member")
    with pytest.raises(AlreadyExists):
        members.add_member(Actor(user=admin), personas.acme.team, newcomer, "viewer")


def test_scope_in_use_cannot_be_deleted(personas):
    ServiceClient.objects.create(project=personas.acme.project, name="app")
    with pytest.raises(InUse) as refused:
        tree.delete_scope(personas.olivia_actor, personas.acme.team)
    assert refused.value.details == {"children": 1}
    with pytest.raises(InUse):
        tree.delete_scope(personas.olivia_actor, personas.acme.project)


def test_every_tree_change_leaves_one_audit_event(personas, django_user_model):
    before = AuditEvent.objects.count()
    team = tree.create_scope(personas.olivia_actor, "team", "infra", "Infrastructure", parent=personas.acme.org)
    tree.rename_scope(personas.olivia_actor, team, "Infra")
    user = django_user_model.objects.create_user("nico")
    membership = members.add_member(personas.olivia_actor, team, user, "viewer")
    members.change_role(personas.olivia_actor, membership, "member")
    members.remove_member(personas.olivia_actor, Membership.objects.get(pk=membership.pk))
    tree.delete_scope(personas.olivia_actor, team)
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True)[before:])
    assert actions == ["scope.create", "scope.rename", "membership.add", "membership.change", "membership.remove",
                       "scope.delete"]
    assert set(AuditEvent.objects.values_list("actor", flat=True)[:6]) == {"user:olivia"}
