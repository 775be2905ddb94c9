"""Personas of the tenancy tests: an org owner, a team member, a project viewer, and an outsider
who owns another organisation."""

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


@pytest.fixture
def api():
    """``api(user)``: an API client signed in as ``user`` through the console's session (``api()``:
    anonymous). Requests send and expect JSON."""
    from rest_framework.test import APIClient

    def make(user=None) -> APIClient:
        client = APIClient()
        client.default_format = "json"
        if user is not None:
            client.force_login(user)
        return client

    return make


@pytest.fixture
def management_key(personas):
    """``management_key(access="management", environment="development", project=None)``: a fresh
    service client of acme/ml/search (or ``project``) and the plaintext of one key of it."""
    from tenancy.services import clients

    counter = iter(range(1, 1000))

    def make(access="management", environment="development", project=None):
        project = project or personas.acme.project
        client = clients.create_client(personas.olivia_actor, project, f"robot-{next(counter)}", access=access,
                                       environment="development")
        credential, plaintext = clients.create_credential(personas.olivia_actor, client, name="ci")
        if environment != "development":
            clients.update_client(personas.olivia_actor, client, environment=environment)
        return types.SimpleNamespace(client=client, credential=credential, key=plaintext)

    return make


# Console fixtures ------------------------------------------------------------------------------------

@pytest.fixture
def browse(personas):
    """``browse(user)``: a Django test client logged in as that person."""
    from django.test import Client

    def as_user(user):
        client = Client()
        client.force_login(user)
        return client

    return as_user


@pytest.fixture
def otto(personas, django_user_model):
    """A second admin of acme: the "someone else" who decides what olivia asks for."""
    user = django_user_model.objects.create_user("otto", "otto@example.org", personas.password)
    Membership.objects.create(user=user, scope=personas.acme.org, role=Role.ADMIN)
    return user


@pytest.fixture
def search_client(personas):
    """A service client of acme/ml/search with one working key (made by olivia)."""
    from tenancy.services import clients

    client = clients.create_client(personas.olivia_actor, personas.acme.project, "indexer")
    credential, plaintext = clients.create_credential(personas.olivia_actor, client, name="ci")
    return types.SimpleNamespace(client=client, credential=credential, plaintext=plaintext)


@pytest.fixture
def ada(personas, django_user_model):
    """A second decider: ada is an admin of acme, so olivia's requests have someone else to approve them."""
    user = django_user_model.objects.create_user("ada", "ada@example.org", personas.password)
    Membership.objects.create(user=user, scope=personas.acme.org, role=Role.ADMIN)
    return user
