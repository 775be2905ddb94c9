"""The approvals inbox and the contract form: refusals name the figures, a raise needs someone else's
approval, and the whole flow runs through the console."""

from decimal import Decimal

import pytest
from django.urls import reverse

from tenancy.models import ApprovalRequest, Contract
from tenancy.services import contracts

pytestmark = pytest.mark.django_db

FIGURES = {"budget_mode": "hard"}


def contract_url(scope):
    return reverse("tenancy:contract", args=[scope.public_id])


def test_owner_sets_a_contract_and_sees_it_on_the_scope_page(personas, browse):
    olivia = browse(personas.olivia)
    form = olivia.get(contract_url(personas.acme.org))
    assert form.status_code == 200 and "GPU memory limit" in form.content.decode()
    response = olivia.post(contract_url(personas.acme.org), {**FIGURES, "gpu_memory_gib_limit": "160",
                                                             "rpm_limit": "1000"})
    assert response.status_code == 302
    contract = Contract.objects.get(scope=personas.acme.org)
    assert contract.gpu_memory_gib_limit == Decimal("160") and contract.rpm_limit == 1000
    page = olivia.get(reverse("tenancy:scope", args=[personas.acme.org.public_id])).content.decode()
    assert "org:acme" in page and ">160<" in page and ">1000<" in page


def test_the_contract_form_sets_a_weekly_budget_and_the_chain_shows_it(personas, browse):
    olivia = browse(personas.olivia)
    form = olivia.get(contract_url(personas.acme.team)).content.decode()
    assert "Weekly token budget (tokens)" in form and 'name="weekly_token_budget"' in form
    assert form.index('name="daily_token_budget"') < form.index('name="weekly_token_budget"') \
        < form.index('name="monthly_token_budget"')
    response = olivia.post(contract_url(personas.acme.team), {**FIGURES, "daily_token_budget": "1000",
                                                              "weekly_token_budget": "5000"})
    assert response.status_code == 302
    assert Contract.objects.get(scope=personas.acme.team).weekly_token_budget == 5000
    page = olivia.get(contract_url(personas.acme.team)).content.decode()
    assert "Tokens/week" in page and ">5000<" in page and 'value="5000"' in page


def test_contract_refusals_name_the_figures_on_the_form(personas, browse):
    olivia = browse(personas.olivia)
    response = olivia.post(contract_url(personas.acme.team), {**FIGURES, "gpus_guarantee": "8", "gpus_limit": "4"})
    assert response.status_code == 400
    page = response.content.decode()
    assert "team:acme/ml: the GPUs guarantee (8) exceeds its limit (4)" in page
    Contract.objects.create(scope=personas.acme.org, gpus_guarantee=Decimal(4))  # set with an approval, say
    response = olivia.post(contract_url(personas.acme.team), {**FIGURES, "gpus_guarantee": "6"})
    assert response.status_code == 400
    page = response.content.decode()
    assert "GPUs guarantees under org:acme would add up to 6, more than its own guarantee of 4" in page
    assert not Contract.objects.filter(scope=personas.acme.team).exists()


def test_raising_a_limit_asks_for_approval_and_another_admin_approves_it(personas, otto, browse):
    olivia, otto_ = browse(personas.olivia), browse(otto)
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpu_memory_gib_limit=Decimal(100))

    refused = olivia.post(contract_url(personas.acme.org), {**FIGURES, "gpu_memory_gib_limit": "160"})
    assert refused.status_code == 428
    page = refused.content.decode()
    assert "needs a second person" in page and "Ask for approval" in page
    assert "&quot;gpu_memory_gib_limit&quot;: &quot;160&quot;" in page  # the evidence, pretty JSON
    asked = olivia.post(reverse("tenancy:approval_ask"), {**refused.context["ask_form"].initial,
                                                          "reason": "new GPUs arrived"})
    assert asked.status_code == 302 and asked["Location"].endswith("?tab=mine")
    approval = ApprovalRequest.objects.get()

    # Four eyes, visible: olivia's own request waits in "mine" without buttons, not in her to-decide tab.
    mine = olivia.get(reverse("tenancy:approvals") + "?tab=mine").content.decode()
    assert "new GPUs arrived" in mine and "someone else must decide it" in mine and "Approve" not in mine
    assert "new GPUs arrived" not in olivia.get(reverse("tenancy:approvals")).content.decode()
    own = olivia.post(reverse("tenancy:approval_decide", args=[approval.public_id]), {"decision": "approve"})
    assert own.status_code == 403 and "someone else must decide" in own.content.decode()

    inbox = otto_.get(reverse("tenancy:approvals")).content.decode()
    assert "new GPUs arrived" in inbox and "Approve" in inbox and "&quot;proposed&quot;" in inbox
    swapped = otto_.post(reverse("tenancy:approval_decide", args=[approval.public_id]),
                         {"decision": "approve", "reason": "budgeted"}, HTTP_HX_REQUEST="true")
    card = swapped.content.decode()
    assert swapped.status_code == 200 and card.lstrip().startswith(f'<article class="panel approval" id="approval-')
    assert "Approved" in card and "budgeted" in card and "Approve</button>" not in card

    mine = olivia.get(reverse("tenancy:approvals") + "?tab=mine").content.decode()
    carry_out = f"{contract_url(personas.acme.org)}?approval={approval.public_id}"
    assert carry_out in mine
    form = olivia.get(carry_out)
    assert form.context["form"].initial["gpu_memory_gib_limit"] == "160"
    done = olivia.post(contract_url(personas.acme.org), {**FIGURES, "gpu_memory_gib_limit": "160",
                                                         "approval": approval.public_id})
    assert done.status_code == 302
    assert Contract.objects.get(scope=personas.acme.org).gpu_memory_gib_limit == Decimal("160")
    approval.refresh_from_db()
    assert approval.status == "used"
    decided = otto_.get(reverse("tenancy:approvals") + "?tab=decided").content.decode()
    assert "new GPUs arrived" in decided and "Used" in decided


def test_rejecting_needs_a_reason_shown_on_the_card(personas, otto, browse):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=Decimal(2))
    olivia = browse(personas.olivia)
    refused = olivia.post(contract_url(personas.acme.org), {**FIGURES, "gpus_limit": "3"})
    olivia.post(reverse("tenancy:approval_ask"), {**refused.context["ask_form"].initial, "reason": "more"})
    approval = ApprovalRequest.objects.get()
    url = reverse("tenancy:approval_decide", args=[approval.public_id])
    otto_ = browse(otto)
    no_reason = otto_.post(url, {"decision": "reject"}, HTTP_HX_REQUEST="true")
    assert no_reason.status_code == 200 and "Say why you reject it." in no_reason.content.decode()
    assert ApprovalRequest.objects.get().status == "pending"
    rejected = otto_.post(url, {"decision": "reject", "reason": "not this quarter"})
    assert rejected.status_code == 302
    assert ApprovalRequest.objects.get().status == "rejected"


def test_inbox_tabs_and_a_request_come_as_page_or_fragment_from_one_url(personas, otto, browse):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=Decimal(2))
    olivia = browse(personas.olivia)
    refused = olivia.post(contract_url(personas.acme.org), {**FIGURES, "gpus_limit": "3"})
    olivia.post(reverse("tenancy:approval_ask"), {**refused.context["ask_form"].initial, "reason": "more"})
    otto_ = browse(otto)
    url = reverse("tenancy:approvals") + "?tab=pending"
    page, fragment = otto_.get(url), otto_.get(url, HTTP_HX_REQUEST="true")
    assert "<html" in page.content.decode()
    assert fragment.content.decode().lstrip().startswith('<div id="approvals-list">')
    assert "HX-Request" in page["Vary"] and "HX-Request" in fragment["Vary"]
    detail = reverse("tenancy:approval", args=[ApprovalRequest.objects.get().public_id])
    assert "<html" in otto_.get(detail).content.decode()
    assert otto_.get(detail, HTTP_HX_REQUEST="true").content.decode().lstrip().startswith("<article")
