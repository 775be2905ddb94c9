"""Schema-driven fuzzing of the management API: schemathesis generates requests for every operation of
the OpenAPI schema and sends them to the live test server as acme's owner, against a world holding one
of every object. Zero server errors, and every answer matches the schema it documents.

Bounded: a fixed number of examples per operation, derandomised (the same requests every run, so a
failure reproduces), no shrinking. The hub is the local stand-in, holding one repository. Excluded: deleting memberships, the only operation that would remove
the persona's own roles (and with them every later request's reach). Work the API queues is recorded,
not sent: no worker runs here, and a queued job must not outlive this test in the shared broker.
"""

from __future__ import annotations

import secrets

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from tests.assets.hub_server import hub, mirror_root  # noqa: F401  (fixtures)
from tests.assets.world import build_world

EXAMPLES_PER_OPERATION = 15
EXCLUDED = {("DELETE", "/api/tenancy/memberships/{public_id}/")}


@pytest.fixture(scope="module")
def api_schema(django_db_setup, django_db_blocker):
    from drf_spectacular.generators import SchemaGenerator

    with django_db_blocker.unblock():
        document = SchemaGenerator().get_schema(request=None, public=True)
    return schemathesis.openapi.from_dict(document)


@pytest.fixture
def fuzz_schema(api_schema):
    return api_schema.exclude(func=lambda ctx: (ctx.operation.method.upper(), ctx.operation.path) in EXCLUDED)


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@pytest.fixture
def owner_session(live_server, personas, monkeypatch, hub, mirror_root, tiny_model):
    """acme's owner signed in (a session cookie and a CSRF pair), over a world of every object, with
    the local stand-in of the hub holding one repository."""
    import httpx
    from celery.app.task import Task
    from django.test import Client

    hub.add("walk/repo", {"walk-Q4_K_M.gguf": tiny_model.read_bytes()})
    queued = []
    monkeypatch.setattr(Task, "apply_async", lambda task, *args, **kwargs: queued.append(task.name))
    world = build_world(personas)
    signed_in = Client()
    signed_in.force_login(personas.olivia)  # a real session, as the login view would leave it
    csrf = secrets.token_hex(16)  # 32 characters: the form of an unmasked CSRF secret
    headers = {"Cookie": f"sessionid={signed_in.cookies['sessionid'].value}; csrftoken={csrf}",
               "X-CSRFToken": csrf, "Accept": "application/json"}
    # The fuzzing means nothing unless its requests are olivia's: check that the server knows her.
    scopes = httpx.get(f"{live_server.url}/api/tenancy/scopes/", headers=headers, timeout=30)
    assert scopes.status_code == 200 and "acme/ml/search" in scopes.text, scopes.text[:300]
    return {"base_url": live_server.url, "world": world, "headers": headers}


@pytest.mark.django_db(transaction=True)
@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_server_error_and_every_answer_matches_the_schema(case, owner_session):
    response = case.call(base_url=owner_session["base_url"], headers=owner_session["headers"], timeout=30)
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
