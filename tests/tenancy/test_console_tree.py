"""The tree with holdings bars, a scope's page, and people with their roles."""

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from tenancy.models import AuditEvent, Contract, Membership, Scope
from tenancy.services import contracts

pytestmark = pytest.mark.django_db


def test_tree_shows_each_visible_scope_on_one_line_with_holdings_bars(personas, browse):
    # A guarantee is set with an approval; this test is about the bars, so the contract is written directly.
    Contract.objects.create(scope=personas.acme.org, gpu_memory_gib_guarantee=Decimal(80),
                            gpu_memory_gib_limit=Decimal(160))
    contracts.reserve(personas.acme.project, "replica:one", gpu_memory_gib=40, gpus=1, cores=4)
    body = browse(personas.olivia).get(reverse("tenancy:index")).content.decode()
    assert body.count('<tr id="scope-') == 3 and "globex" not in body
    org_row = body.split(f'<tr id="scope-{personas.acme.org.public_id}">')[1].split("</tr>")[0]
    assert "GPU memory: 40 GiB held, guarantee 80, limit 160" in org_row
    assert 'style="width: 25%"' in org_row and 'style="left: 50%"' in org_row and ">40/160<" in org_row
    project_row = body.split(f'<tr id="scope-{personas.acme.project.public_id}">')[1].split("</tr>")[0]
    assert "\u2003\u2003Search" in project_row  # indented two levels under acme


def test_tree_page_and_fragment_come_from_one_url(personas, browse):
    olivia = browse(personas.olivia)
    page, fragment = olivia.get(reverse("tenancy:index")), olivia.get(reverse("tenancy:index"), HTTP_HX_REQUEST="true")
    assert "<html" in page.content.decode()
    assert fragment.content.decode().lstrip().startswith('<div id="tree-table"')
    assert "HX-Request" in fragment["Vary"]


def test_scope_page_shows_children_members_clients_and_contract(personas, search_client, browse):
    contracts.set_contract(personas.olivia_actor, personas.acme.team, cores_limit=Decimal(64))
    body = browse(personas.max).get(reverse("tenancy:scope", args=[personas.acme.team.public_id])).content.decode()
    assert "project:acme/ml/search" in body and "max" in body and "indexer" in body and ">64<" in body
    assert "org:acme" not in body  # max cannot see the organisation's row or contract


def test_owner_creates_a_team_under_the_organisation(personas, browse):
    response = browse(personas.olivia).post(reverse("tenancy:scope_create", args=[personas.acme.org.public_id]),
                                            {"slug": "data", "name": "Data"})
    team = Scope.objects.get(path="acme/data")
    assert response.status_code == 302 and response["Location"] == reverse("tenancy:scope", args=[team.public_id])


def test_people_add_change_and_remove_roles(personas, browse):
    olivia = browse(personas.olivia)
    page = olivia.get(reverse("tenancy:people")).content.decode()
    assert page.count('<tr id="membership-') == 3 and "oscar" not in page
    added = olivia.post(reverse("tenancy:member_add"), {"scope": personas.acme.team.public_id, "username": "oscar",
                                                        "role": "viewer", "next": reverse("tenancy:people")})
    assert added.status_code == 302 and added["Location"] == reverse("tenancy:people")
    membership = Membership.objects.get(user=personas.oscar, scope=personas.acme.team)
    row = olivia.post(reverse("tenancy:membership_role", args=[membership.public_id]), {"role": "admin"},
                      HTTP_HX_REQUEST="true").content.decode()
    assert row.startswith(f'<tr id="membership-{membership.public_id}">') and ">Admin<" in row
    gone = olivia.post(reverse("tenancy:membership_remove", args=[membership.public_id]), HTTP_HX_REQUEST="true")
    assert gone.status_code == 200 and gone.content == b""
    assert not Membership.objects.filter(pk=membership.pk).exists()
    unknown = olivia.post(reverse("tenancy:member_add"), {"scope": personas.acme.team.public_id,
                                                          "username": "nobody", "role": "viewer"}, follow=True)
    assert "No user &#x27;nobody&#x27;." in unknown.content.decode()


def test_audit_filters_by_actor_action_scope_and_time_and_exports_json_lines(personas, search_client, browse):
    contracts.set_contract(personas.olivia_actor, personas.acme.team, cores_limit=Decimal(64))
    contracts.set_contract(personas.oscar_actor, personas.globex.team, cores_limit=Decimal(8))
    olivia = browse(personas.olivia)
    url = reverse("tenancy:audit")

    def actions(query):
        table = olivia.get(url, query).context["table"]
        return [event.action for event in table.rows]

    assert set(actions({})) == {"client.create", "credential.create", "contract.set"}  # acme's, not globex's
    assert actions({"action": "credential"}) == ["credential.create"]
    assert actions({"action": "contract.set"}) == ["contract.set"]
    assert actions({"actor": "olivia", "scope": "team:acme/ml", "action": "contract"}) == ["contract.set"]
    assert set(actions({"scope": "acme/ml/search"})) == {"client.create", "credential.create"}
    assert actions({"actor": "oscar"}) == []
    future = (timezone.localtime() + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    past = (timezone.localtime() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert actions({"since": future}) == []
    assert len(actions({"since": past, "until": future})) == 3
    fragment = olivia.get(url, {"action": "credential"}, HTTP_HX_REQUEST="true").content.decode()
    assert fragment.lstrip().startswith('<div id="audit-table">') and "action=credential" in fragment

    export = olivia.get(reverse("tenancy:audit_export"), {"scope": "acme/ml/search"})
    assert export["Content-Disposition"].startswith("attachment;")
    lines = [json.loads(line) for line in b"".join(export.streaming_content).decode().splitlines()]
    assert [line["action"] for line in lines] == ["client.create", "credential.create"]
    assert search_client.plaintext not in json.dumps(lines)
    assert AuditEvent.objects.count() == 4
