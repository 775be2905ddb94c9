"""Service clients and their keys in the console: a key's plaintext is shown once, revoke swaps
its row, rotate shows the new key once and keeps the old working for the overlap, production keys
need a second person."""

import pytest
from django.urls import reverse

from tenancy.models import ApprovalRequest, Credential, ServiceClient
from tenancy.services import clients

pytestmark = pytest.mark.django_db


def test_a_new_keys_plaintext_is_in_the_create_response_and_on_no_later_page(personas, search_client, browse):
    olivia = browse(personas.olivia)
    client = search_client.client
    response = olivia.post(reverse("tenancy:key_create", args=[client.public_id]), {"name": "deploy",
                                                                                    "lifetime_days": 30})
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
    page = response.content.decode()
    credential = Credential.objects.get(client=client, name="deploy")
    plaintext = response.context["plaintext"]
    assert plaintext.startswith(credential.prefix + "_")
    assert plaintext in page and "navigator.clipboard.writeText" in page and "cannot show it again" in page
    assert credential.expires_at is not None
    later = [reverse("tenancy:client", args=[client.public_id]), reverse("tenancy:clients"),
             reverse("tenancy:scope", args=[personas.acme.project.public_id]), reverse("tenancy:audit")]
    for url in later:
        body = olivia.get(url).content.decode()
        assert plaintext not in body and plaintext.split("_", 2)[2] not in body, url
    assert credential.prefix in olivia.get(later[0]).content.decode()


def test_revoking_a_key_through_htmx_swaps_its_row(personas, search_client, browse):
    olivia = browse(personas.olivia)
    key = search_client.credential
    response = olivia.post(reverse("tenancy:key_revoke", args=[key.public_id]), HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    row = response.content.decode()
    assert row.startswith(f'<tr id="key-{key.public_id}">') and row.rstrip().endswith("</tr>")
    assert ">revoked<" in row and "Revoke" not in row and "Rotate" not in row
    key.refresh_from_db()
    assert key.revoked_at is not None
    # A plain form post (no JavaScript) lands back on the client's page.
    again = olivia.post(reverse("tenancy:key_revoke", args=[key.public_id]))
    assert again.status_code == 302 and again["Location"] == reverse("tenancy:client", args=[key.client.public_id])


def test_rotating_shows_the_new_key_once_and_the_old_one_works_for_the_overlap(personas, search_client, browse):
    max_ = browse(personas.max)
    old = search_client.credential
    response = max_.post(reverse("tenancy:key_rotate", args=[old.public_id]), {"overlap_hours": 2})
    assert response.status_code == 201
    new = Credential.objects.get(replaces=old)
    plaintext = response.context["plaintext"]
    page = response.content.decode()
    assert plaintext in page and plaintext.startswith(new.prefix) and f"replacing {old.prefix}" in page
    assert clients.authenticate(plaintext).pk == new.pk
    assert clients.authenticate(search_client.plaintext).pk == old.pk  # inside the overlap
    old.refresh_from_db()
    assert old.expires_at is not None
    later = max_.get(reverse("tenancy:client", args=[old.client.public_id])).content.decode()
    assert plaintext not in later and "rotated, works until" in later


def test_a_production_key_needs_someone_elses_approval_end_to_end(personas, browse):
    max_, olivia = browse(personas.max), browse(personas.olivia)
    client = clients.create_client(personas.max_actor, personas.acme.project, "prod-api", environment="production")
    url = reverse("tenancy:key_create", args=[client.public_id])

    refused = max_.post(url, {"name": "live"})
    assert refused.status_code == 428
    page = refused.content.decode()
    assert "needs a second person&#x27;s approval" in page and "Ask for approval" in page
    assert "&quot;environment&quot;: &quot;production&quot;" in page  # the evidence, shown and pre-filled
    ask = refused.context["ask_form"]
    asked = max_.post(reverse("tenancy:approval_ask"), {**ask.initial, "reason": "launch of search v2"})
    assert asked.status_code == 302
    approval = ApprovalRequest.objects.get(action="credential.create_production")
    assert approval.requested_by == personas.max and approval.subject_id == str(client.public_id)

    decided = olivia.post(reverse("tenancy:approval_decide", args=[approval.public_id]),
                          {"decision": "approve", "reason": "ok"}, HTTP_HX_REQUEST="true")
    assert decided.status_code == 200 and "Approved" in decided.content.decode()

    form = max_.get(reverse("tenancy:client", args=[client.public_id]) + f"?approval={approval.public_id}")
    assert f'value="{approval.public_id}" selected' in form.content.decode()
    created = max_.post(url, {"name": "live", "approval": approval.public_id})
    assert created.status_code == 201 and created.context["plaintext"] in created.content.decode()
    approval.refresh_from_db()
    assert approval.status == "used"
    # Used once: a second key needs a second approval.
    assert max_.post(url, {"name": "again", "approval": approval.public_id}).status_code in (400, 428)


def test_client_list_shows_one_line_per_client_with_working_key_counts(personas, search_client, browse):
    clients.create_client(personas.olivia_actor, personas.acme.project, "batch", environment="staging")
    body = browse(personas.vera).get(reverse("tenancy:clients")).content.decode()
    assert body.count('<tr id="client-') == 2
    assert "indexer" in body and "batch" in body and "Staging" in body
    assert ServiceClient.objects.count() == 2


def test_a_member_may_revoke_but_not_rotate_a_management_clients_key(personas, browse):
    """Rotating mints a key, which for a client with management access takes an admin: the button is
    offered to those who may press it."""
    from tenancy.services import clients

    robot = clients.create_client(personas.olivia_actor, personas.acme.project, "robot", access="management")
    key, _ = clients.create_credential(personas.olivia_actor, robot, name="ci")
    page = reverse("tenancy:client", args=[robot.public_id])
    as_member = browse(personas.max).get(page).content.decode()
    row = as_member[as_member.index(f'id="key-{key.public_id}"'):].split("</tr>", 1)[0]
    assert "Revoke" in row and "Rotate" not in row
    as_owner = browse(personas.olivia).get(page).content.decode()
    row = as_owner[as_owner.index(f'id="key-{key.public_id}"'):].split("</tr>", 1)[0]
    assert "Revoke" in row and "Rotate" in row
