"""Who sees and does what in the Organisations console: the outsider gets 404s, the viewer reads
without buttons and gets 403 for changes, the member does what a member may, the owner all."""

import pytest
from django.urls import reverse

from tenancy.models import ApprovalRequest, Credential, Membership, ServiceClient
from tenancy.services import approvals

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme_request(personas, search_client):
    """A pending approval request of max (a production key for a production client of acme)."""
    from tenancy.services import clients

    client = clients.create_client(personas.max_actor, personas.acme.project, "prod-api", environment="production")
    return approvals.request_approval(personas.max_actor, "credential.create_production", personas.acme.project,
                                      client, clients.production_evidence(client), "launch")


def acme_urls(personas, search_client, acme_request):
    membership = Membership.objects.get(user=personas.vera)
    return {
        "scope": reverse("tenancy:scope", args=[personas.acme.project.public_id]),
        "contract": reverse("tenancy:contract", args=[personas.acme.project.public_id]),
        "client": reverse("tenancy:client", args=[search_client.client.public_id]),
        "approval": reverse("tenancy:approval", args=[acme_request.public_id]),
        "membership": reverse("tenancy:membership_role", args=[membership.public_id]),
    }


@pytest.mark.parametrize("name", ["index", "people", "clients", "client_create", "approvals", "audit", "audit_export"])
def test_anonymous_visitor_is_sent_to_login(client, name):
    response = client.get(reverse(f"tenancy:{name}"))
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_outsider_gets_404_for_every_page_of_another_orgs_objects(personas, search_client, acme_request, browse):
    oscar = browse(personas.oscar)
    urls = acme_urls(personas, search_client, acme_request)
    for name in ("scope", "contract", "client", "approval"):
        assert oscar.get(urls[name]).status_code == 404, name


def test_outsider_gets_404_for_every_change_to_another_orgs_objects(personas, search_client, acme_request, browse):
    oscar = browse(personas.oscar)
    project = personas.acme.project
    key = search_client.credential
    membership = Membership.objects.get(user=personas.vera)
    posts = {
        "revoke": (reverse("tenancy:key_revoke", args=[key.public_id]), {}),
        "rotate": (reverse("tenancy:key_rotate", args=[key.public_id]), {"overlap_hours": 1}),
        "create key": (reverse("tenancy:key_create", args=[search_client.client.public_id]), {"name": "x"}),
        "create client": (reverse("tenancy:client_create"), {"project": project.public_id, "name": "x",
                                                              "environment": "development", "access": "inference",
                                                              "priority": "normal"}),
        "add member": (reverse("tenancy:member_add"), {"scope": project.public_id, "username": "oscar",
                                                        "role": "owner"}),
        "change role": (reverse("tenancy:membership_role", args=[membership.public_id]), {"role": "owner"}),
        "remove member": (reverse("tenancy:membership_remove", args=[membership.public_id]), {}),
        "contract": (reverse("tenancy:contract", args=[project.public_id]), {"budget_mode": "hard"}),
        "add team": (reverse("tenancy:scope_create", args=[personas.acme.org.public_id]), {"slug": "evil"}),
        "decide": (reverse("tenancy:approval_decide", args=[acme_request.public_id]), {"decision": "approve"}),
        "ask": (reverse("tenancy:approval_ask"), {"action": "contract.raise_limit", "subject": project.public_id,
                                                  "evidence": "{}", "reason": "please"}),
    }
    for name, (url, data) in posts.items():
        assert oscar.post(url, data).status_code == 404, name
    key.refresh_from_db()
    assert key.revoked_at is None and not hasattr(key, "replaced_by")
    assert Membership.objects.get(pk=membership.pk).role == "viewer"
    assert ApprovalRequest.objects.get(pk=acme_request.pk).status == "pending"
    assert not ServiceClient.objects.filter(name="x").exists()


def test_outsider_sees_nothing_of_acme_in_any_list(personas, search_client, acme_request, browse):
    oscar = browse(personas.oscar)
    for name in ("index", "people", "clients", "approvals", "audit", "audit_export"):
        body = b"".join(oscar.get(reverse(f"tenancy:{name}") + "?tab=decided").streaming_content) \
            if name == "audit_export" else oscar.get(reverse(f"tenancy:{name}")).content
        assert b"acme" not in body, name
    assert b"globex" in oscar.get(reverse("tenancy:index")).content


def test_viewer_sees_the_project_but_no_button_that_changes_it(personas, search_client, acme_request, browse):
    vera = browse(personas.vera)
    urls = acme_urls(personas, search_client, acme_request)
    scope_page = vera.get(urls["scope"]).content.decode()
    assert "indexer" in scope_page and "vera" in scope_page
    for button in ("Edit contract", "Add member", "New service client", ">Remove<", ">Change<"):
        assert button not in scope_page, button
    client_page = vera.get(urls["client"]).content.decode()
    assert search_client.credential.prefix in client_page
    for button in ("Revoke", "Rotate", "Create key"):
        assert button not in client_page, button
    approval_page = vera.get(urls["approval"]).content.decode()
    assert "launch" in approval_page and "Approve" not in approval_page
    tree = vera.get(reverse("tenancy:index")).content.decode()
    assert "acme/ml/search" in tree and "project:acme/ml/search" in tree
    assert "team:acme/ml" not in tree  # she sees her project, not the team above it


def test_viewer_gets_403_for_every_change_to_what_she_can_see(personas, search_client, acme_request, browse):
    vera = browse(personas.vera)
    project = personas.acme.project
    key = search_client.credential
    membership = Membership.objects.get(user=personas.vera)
    posts = {
        "revoke": (reverse("tenancy:key_revoke", args=[key.public_id]), {}),
        "revoke (htmx)": (reverse("tenancy:key_revoke", args=[key.public_id]), {}),
        "rotate": (reverse("tenancy:key_rotate", args=[key.public_id]), {"overlap_hours": 1}),
        "create key": (reverse("tenancy:key_create", args=[search_client.client.public_id]), {"name": "x"}),
        "create client": (reverse("tenancy:client_create"), {"project": project.public_id, "name": "x",
                                                              "environment": "development", "access": "inference",
                                                              "priority": "normal"}),
        "add member": (reverse("tenancy:member_add"), {"scope": project.public_id, "username": "oscar",
                                                        "role": "viewer"}),
        "change own role": (reverse("tenancy:membership_role", args=[membership.public_id]), {"role": "owner"}),
        "contract": (reverse("tenancy:contract", args=[project.public_id]), {"budget_mode": "hard"}),
        "decide": (reverse("tenancy:approval_decide", args=[acme_request.public_id]), {"decision": "approve"}),
        "ask": (reverse("tenancy:approval_ask"), {"action": "contract.raise_limit", "subject": project.public_id,
                                                  "evidence": "{}", "reason": "please"}),
    }
    for name, (url, data) in posts.items():
        extra = {"HTTP_HX_REQUEST": "true"} if "htmx" in name else {}
        assert vera.post(url, data, **extra).status_code == 403, name
    assert vera.get(reverse("tenancy:contract", args=[project.public_id])).status_code == 403
    key.refresh_from_db()
    assert key.revoked_at is None
    assert Membership.objects.get(pk=membership.pk).role == "viewer"
    assert ApprovalRequest.objects.get(pk=acme_request.pk).status == "pending"


def test_member_creates_a_client_and_a_key_in_his_teams_project(personas, browse):
    max_ = browse(personas.max)
    form = max_.get(reverse("tenancy:client_create") + f"?project={personas.acme.project.public_id}")
    assert form.status_code == 200 and "project:acme/ml/search" in form.content.decode()
    response = max_.post(reverse("tenancy:client_create"), {
        "project": personas.acme.project.public_id, "name": "ranker", "environment": "staging",
        "access": "inference", "priority": "high", "allowed_models": "qwen, llama", "rpm_limit": 600})
    client = ServiceClient.objects.get(name="ranker")
    assert response.status_code == 302 and response["Location"] == reverse("tenancy:client", args=[client.public_id])
    assert client.allowed_models == ["qwen", "llama"] and client.rpm_limit == 600
    created = max_.post(reverse("tenancy:key_create", args=[client.public_id]), {"name": "ci"})
    assert created.status_code == 201
    assert Credential.objects.get(client=client).created_by == personas.max


def test_member_may_not_edit_contracts_or_memberships(personas, browse):
    max_ = browse(personas.max)
    team = personas.acme.team
    assert "Edit contract" not in max_.get(reverse("tenancy:scope", args=[team.public_id])).content.decode()
    assert max_.get(reverse("tenancy:contract", args=[team.public_id])).status_code == 403
    assert max_.post(reverse("tenancy:contract", args=[team.public_id]),
                     {"gpus_limit": "4", "budget_mode": "hard"}).status_code == 403
    refused = max_.post(reverse("tenancy:member_add"), {"scope": team.public_id, "username": "oscar",
                                                         "role": "viewer"})
    assert refused.status_code == 403
    # He cannot learn from the refusal whether a username exists.
    assert max_.post(reverse("tenancy:member_add"), {"scope": team.public_id, "username": "nobody-at-all",
                                                     "role": "viewer"}).status_code == 403
    assert not Membership.objects.filter(user=personas.oscar, scope=team).exists()


def test_owner_sees_every_button(personas, search_client, browse):
    olivia = browse(personas.olivia)
    scope_page = olivia.get(reverse("tenancy:scope", args=[personas.acme.project.public_id])).content.decode()
    for button in ("Edit contract", "Add member", "New service client", ">Remove<", ">Change<"):
        assert button in scope_page, button
    client_page = olivia.get(reverse("tenancy:client", args=[search_client.client.public_id])).content.decode()
    for button in ("Revoke", "Rotate", "Create key"):
        assert button in client_page, button
