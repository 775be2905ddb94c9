"""Four eyes: the requester cannot decide; approvals expire, are used once, and go stale."""

from datetime import timedelta

import pytest
from django.utils import timezone

from tenancy.audit import Actor
from tenancy.errors import ApprovalExpired, ApprovalInvalid, FourEyes, InvalidTree
from tenancy.models import ApprovalRequest, AuditEvent, Membership
from tenancy.services import approvals, contracts

pytestmark = pytest.mark.django_db


@pytest.fixture
def second_admin(personas, django_user_model):
    user = django_user_model.objects.create_user("sam")
    Membership.objects.create(user=user, scope=personas.acme.org, role="admin")
    return Actor(user=user)


@pytest.fixture
def raise_request(personas):
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=4)
    contract = personas.acme.org.contract
    before = {name: getattr(contract, name) for name in contracts.FIELDS}
    evidence = contracts.contract_evidence(personas.acme.org, before, before | {"gpus_limit": 8})
    return approvals.request_approval(personas.olivia_actor, "contract.raise_limit", personas.acme.org,
                                      personas.acme.org, evidence, "a second node")


def test_fingerprint_is_the_sha256_of_canonical_json():
    assert approvals.fingerprint({"b": 1, "a": [1, 2]}) == approvals.fingerprint({"a": [1, 2], "b": 1})
    assert approvals.fingerprint({"a": 1}) != approvals.fingerprint({"a": 2})
    assert len(approvals.fingerprint({})) == 64


def test_requester_cannot_approve_their_own_request(personas, raise_request):
    with pytest.raises(FourEyes):
        approvals.decide(personas.olivia_actor, raise_request, approve=True)


def test_member_cannot_decide(personas, raise_request):
    from tenancy.errors import Forbidden

    with pytest.raises((Forbidden, Exception)) as refused:
        approvals.decide(personas.max_actor, raise_request, approve=True)
    assert refused.value.status in (403, 404)


def test_approved_action_is_carried_out_once(personas, raise_request, second_admin):
    approvals.decide(second_admin, raise_request, approve=True)
    contracts.set_contract(personas.olivia_actor, personas.acme.org, approval=raise_request.public_id, gpus_limit=8)
    assert personas.acme.org.contract.__class__.objects.get(scope=personas.acme.org).gpus_limit == 8
    contracts.set_contract(personas.olivia_actor, personas.acme.org, gpus_limit=4)
    with pytest.raises(ApprovalInvalid, match="already used"):
        contracts.set_contract(personas.olivia_actor, personas.acme.org, approval=raise_request.public_id, gpus_limit=8)


def test_rejection_needs_a_reason_and_cannot_be_used(personas, raise_request, second_admin):
    with pytest.raises(InvalidTree):
        approvals.decide(second_admin, raise_request, approve=False, reason=" ")
    approvals.decide(second_admin, raise_request, approve=False, reason="not this quarter")
    with pytest.raises(ApprovalInvalid, match="rejected"):
        contracts.set_contract(personas.olivia_actor, personas.acme.org, approval=raise_request.public_id, gpus_limit=8)


def test_expired_approval_is_refused(personas, raise_request, second_admin):
    approvals.decide(second_admin, raise_request, approve=True)
    ApprovalRequest.objects.filter(pk=raise_request.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(ApprovalExpired):
        contracts.set_contract(personas.olivia_actor, personas.acme.org, approval=raise_request.public_id, gpus_limit=8)


def test_pending_request_expires_before_a_decision(personas, raise_request, second_admin):
    ApprovalRequest.objects.filter(pk=raise_request.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(ApprovalExpired):
        approvals.decide(second_admin, raise_request, approve=True)


def test_approval_for_another_subject_is_refused(personas, raise_request, second_admin):
    approvals.decide(second_admin, raise_request, approve=True)
    contracts.set_contract(personas.olivia_actor, personas.acme.team, gpus_limit=4)
    with pytest.raises(ApprovalInvalid, match="not for this action on this object"):
        contracts.set_contract(personas.olivia_actor, personas.acme.team, approval=raise_request.public_id, gpus_limit=8)


def test_unknown_action_and_missing_reason_are_refused(personas):
    with pytest.raises(InvalidTree):
        approvals.request_approval(personas.olivia_actor, "scope.delete", personas.acme.org, personas.acme.org, {}, "x")
    with pytest.raises(InvalidTree):
        approvals.request_approval(personas.olivia_actor, "contract.raise_limit", personas.acme.org,
                                   personas.acme.org, {}, "")


def test_each_step_leaves_one_audit_event(personas, raise_request, second_admin):
    approvals.decide(second_admin, raise_request, approve=True)
    contracts.set_contract(personas.olivia_actor, personas.acme.org, approval=raise_request.public_id, gpus_limit=8)
    actions = list(AuditEvent.objects.filter(object_type="tenancy.approvalrequest").order_by("id")
                   .values_list("action", flat=True))
    assert actions == ["approval.request", "approval.approve", "approval.use"]
