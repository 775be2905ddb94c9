"""Personas shared by every area's tests: an org owner, a team member, a project viewer, and an
outsider who owns another organisation."""

from __future__ import annotations

import types

import pytest

from tenancy.audit import Actor
from tenancy.models import Membership, Role, Scope


def make_tree(org: str) -> types.SimpleNamespace:
    org_scope = Scope.objects.create(kind="org", slug=org, name=org.title(), path=org)
    team = Scope.objects.create(kind="team", slug="ml", name="ML", parent=org_scope, path=f"{org}/ml")
    project = Scope.objects.create(kind="project", slug="search", name="Search", parent=team,
                                   path=f"{org}/ml/search")
    return types.SimpleNamespace(org=org_scope, team=team, project=project)


@pytest.fixture
def personas(db, django_user_model):
    """acme (olivia owns it; max is a member of acme/ml; vera views acme/ml/search) and globex
    (oscar owns it, and is an outsider to acme)."""
    acme, globex = make_tree("acme"), make_tree("globex")
    people = {}
    for username, scope, role in (("olivia", acme.org, Role.OWNER), ("max", acme.team, Role.MEMBER),
                                  ("vera", acme.project, Role.VIEWER), ("oscar", globex.org, Role.OWNER)):
        user = django_user_model.objects.create_user(username, f"{username}@example.org", "a-long-test-password")
        Membership.objects.create(user=user, scope=scope, role=role)
        people[username] = user
    return types.SimpleNamespace(acme=acme, globex=globex, password="a-long-test-password",
                                 **people, **{f"{name}_actor": Actor(user=user) for name, user in people.items()})
