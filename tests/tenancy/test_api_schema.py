"""The tenancy API documents itself without warnings, and its lists cost the same number of
queries however many rows they show (no N+1)."""

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tenancy.services import clients, contracts, tree

pytestmark = pytest.mark.django_db


def test_schema_generates_without_warnings_about_tenancy_and_lists_its_endpoints(tmp_path, api, admin_user, capsys):
    # drf-spectacular prints each warning (an unresolvable serializer or field) on stderr, naming the
    # view's file. Other apps answer for their own.
    call_command("spectacular", "--validate", "--file", str(tmp_path / "schema.yaml"))
    complaints = [line for line in capsys.readouterr().err.splitlines()
                  if ("Warning" in line or "Error" in line) and "tenancy" in line]
    assert complaints == []
    schema = api(admin_user).get("/api/schema/", HTTP_ACCEPT="application/json").json()
    # Tenancy's enums that share a field name with other apps' ("kind", "state") are named components,
    # so they never enter an enum name collision.
    assert {"ScopeKind", "CredentialState"} <= set(schema["components"]["schemas"])
    paths = schema["paths"]
    for path in ("/api/tenancy/scopes/", "/api/tenancy/memberships/", "/api/tenancy/clients/",
                 "/api/tenancy/credentials/{public_id}/rotate/", "/api/tenancy/contracts/{scope_id}/",
                 "/api/tenancy/contracts/check/", "/api/tenancy/approvals/{public_id}/approve/",
                 "/api/tenancy/audit/export/"):
        assert path in paths


def queries(client, url) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured)


def add_rows(personas, start: int, count: int) -> None:
    for n in range(start, start + count):
        project = tree.create_scope(personas.olivia_actor, "project", f"p{n}", parent=personas.acme.team)
        contracts.reserve(project, f"replica:{n}", gpus=1)
        client = clients.create_client(personas.olivia_actor, project, f"bot-{n}")
        clients.create_credential(personas.olivia_actor, client)
        contracts.set_contract(personas.olivia_actor, project, gpus_limit=2)


@pytest.mark.parametrize("url", ["/api/tenancy/scopes/", "/api/tenancy/memberships/", "/api/tenancy/clients/",
                                 "/api/tenancy/credentials/", "/api/tenancy/contracts/", "/api/tenancy/approvals/",
                                 "/api/tenancy/audit/"])
def test_lists_cost_the_same_queries_for_more_rows(personas, api, url):
    olivia = api(personas.olivia)
    add_rows(personas, 0, 2)
    few = queries(olivia, url)
    add_rows(personas, 2, 5)
    assert queries(olivia, url) == few
