"""Personas of the tenancy tests: an org owner, a team member, a project viewer, and an outsider
who owns another organisation."""

from __future__ import annotations

import types

import pytest

from tenancy.audit import Actor
from tenancy.models import Membership, Role, Scope
from tests.assets.personas import make_tree, personas  # noqa: F401  (shared with other areas' tests)


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
def management_key(personas, request):
    """``management_key(access="management", environment="development", project=None)``: a fresh
    service client of acme/ml/search (or ``project``), made by olivia, and the plaintext of one key of
    it. A production client's key is minted with a real approval: olivia asks, ada decides."""
    from tenancy.services import approvals, clients

    counter = iter(range(1, 1000))

    def make(access="management", environment="development", project=None):
        project = project or personas.acme.project
        client = clients.create_client(personas.olivia_actor, project, f"robot-{next(counter)}", access=access,
                                       environment=environment)
        approval = None
        if environment == "production":
            approval = approvals.request_approval(personas.olivia_actor, "credential.create_production", project,
                                                  client, clients.production_evidence(client), "a test's robot")
            approvals.decide(Actor(user=request.getfixturevalue("ada")), approval, True)
        credential, plaintext = clients.create_credential(personas.olivia_actor, client, name="ci", approval=approval)
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
