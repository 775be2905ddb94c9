"""Four-eyes approvals: ask, decide, and consume exactly once against unchanged evidence.

The action that needs an approval builds its evidence (a JSON document describing what will
happen and the state it happens in). Asking stores that evidence and its fingerprint. Carrying the
action out rebuilds the evidence from the current state: if its fingerprint differs, something
changed since the approval and it is refused as stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.errors import ApprovalExpired, ApprovalInvalid, ApprovalRequired, ApprovalStale, FourEyes, InvalidTree
from tenancy.models import ApprovalRequest, Scope


@dataclasses.dataclass(frozen=True)
class Policy:
    action: str
    description: str


# Actions that never happen without a second person. Later issues register theirs with
# ``register_policy`` (e.g. promoting a deployment to production, deploying in the critical class).
POLICIES: dict[str, Policy] = {}


def register_policy(action: str, description: str) -> Policy:
    policy = POLICIES[action] = Policy(action, description)
    return policy


register_policy("contract.raise_limit", "Raising a limit of a capacity contract (or removing one), softening a "
                "hard budget, or raising a guarantee.")
register_policy("credential.create_production", "Creating an API key for a production service client.")


def fingerprint(evidence: Any) -> str:
    canonical = json.dumps(evidence, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def subject_ref(subject: Any) -> tuple[str, str, str]:
    return subject._meta.label_lower, str(getattr(subject, "public_id", subject.pk)), str(subject)[:300]


def needed(action: str, evidence: Any, scope: Scope) -> dict:
    """The ApprovalRequired error's details: what to ask for, so a client can file the request."""
    return {"action": action, "scope": scope.written, "evidence": evidence, "fingerprint": fingerprint(evidence)}


def require_asker(actor: Actor, action: str, scope: Scope) -> None:
    """Whether ``actor`` may ask for ``action`` on ``scope``. Checked before anything is read about
    the evidence, so a caller who may not ask gets a 403 (or 404), never an answer about the evidence."""
    if action not in POLICIES:
        raise InvalidTree(f"{action!r} needs no approval.", details={"actions": sorted(POLICIES)})
    if actor.user is None:
        raise FourEyes("Approvals are asked for and decided by people, not service clients.")
    access.require(actor, "use", scope)


def request_approval(actor: Actor, action: str, scope: Scope, subject: Any, evidence: Any,
                     reason: str, *, expected_fingerprint: str | None = None) -> ApprovalRequest:
    """Ask for ``action``. ``expected_fingerprint``: that of the approval_required answer the caller
    acts on; refused as stale when the evidence rebuilt now differs from it."""
    require_asker(actor, action, scope)
    reason = (reason or "").strip()
    if not reason:
        raise InvalidTree("Say why: an approval request needs a reason.", details={"reason": "required"})
    if expected_fingerprint and expected_fingerprint != fingerprint(evidence):
        raise ApprovalStale("Things changed since that approval_required answer: look at the evidence as it is now "
                            "and ask again.", details={"now": evidence, "fingerprint": fingerprint(evidence)})
    subject_type, subject_id, subject_repr = subject_ref(subject)
    with transaction.atomic():
        approval = ApprovalRequest.objects.create(
            scope=scope, action=action, subject_type=subject_type, subject_id=subject_id, subject_repr=subject_repr,
            requested_by=actor.user, reason=reason, evidence=evidence, fingerprint=fingerprint(evidence),
            expires_at=timezone.now() + timedelta(hours=settings.APPROVAL_TTL_HOURS))
        audit.record(actor, "approval.request", approval, details={"action": action, "subject": subject_repr,
                                                                    "fingerprint": approval.fingerprint})
    return approval


def decide(actor: Actor, approval: ApprovalRequest, approve: bool, reason: str = "") -> ApprovalRequest:
    access.require(actor, "decide", approval)
    if actor.user is None:
        raise FourEyes("Approvals are decided by people, not service clients.")
    with transaction.atomic():
        locked = ApprovalRequest.objects.select_for_update().get(pk=approval.pk)
        if locked.requested_by_id == actor.user.pk:
            raise FourEyes("You asked for this approval: someone else must decide it.")
        if locked.status != ApprovalRequest.Status.PENDING:
            raise ApprovalInvalid(f"This request is already {locked.status}.")
        if locked.expires_at <= timezone.now():
            raise ApprovalExpired("This request expired before it was decided; ask again.")
        if not approve and not (reason or "").strip():
            raise InvalidTree("Say why you reject it.", details={"reason": "required"})
        locked.status = ApprovalRequest.Status.APPROVED if approve else ApprovalRequest.Status.REJECTED
        locked.decided_by = actor.user
        locked.decided_at = timezone.now()
        locked.decision_reason = (reason or "").strip()
        locked.save(update_fields=["status", "decided_by", "decided_at", "decision_reason"])
        audit.record(actor, "approval.approve" if approve else "approval.reject", locked,
                     details={"action": locked.action, "reason": locked.decision_reason})
    return locked


def consume(actor: Actor, action: str, scope: Scope, subject: Any, evidence: Any,
            approval: ApprovalRequest | str | None) -> ApprovalRequest:
    """Use an approval for ``action`` now. Call inside the action's own transaction: the approval is
    spent only if the action commits. Without a usable approval, ApprovalRequired says what to ask."""
    if approval is None:
        raise ApprovalRequired(f"{POLICIES[action].description} needs a second person's approval: "
                               "ask for one, then repeat this with its id.",
                               details=needed(action, evidence, scope))
    approval_id = approval.public_id if isinstance(approval, ApprovalRequest) else approval
    locked = (ApprovalRequest.objects.select_for_update()
              .filter(public_id=approval_id).first() if _is_uuid(approval_id) else None)
    subject_type, subject_id, _ = subject_ref(subject)
    if locked is None or locked.action != action or locked.subject_type != subject_type \
            or locked.subject_id != subject_id or not access.can(actor, "view", locked):
        raise ApprovalInvalid("That approval is not for this action on this object.")
    if locked.status == ApprovalRequest.Status.USED:
        raise ApprovalInvalid("That approval was already used; an approval allows one action.")
    if locked.status != ApprovalRequest.Status.APPROVED:
        raise ApprovalInvalid(f"That approval is {locked.status}, not approved.")
    if locked.expires_at <= timezone.now():
        raise ApprovalExpired("That approval has expired; ask again.")
    if fingerprint(evidence) != locked.fingerprint:
        raise ApprovalStale("Things changed since this was approved (the evidence no longer matches); "
                            "ask for a new approval.", details={"approved": locked.evidence, "now": evidence})
    locked.status = ApprovalRequest.Status.USED
    locked.used_at = timezone.now()
    locked.save(update_fields=["status", "used_at"])
    audit.record(actor, "approval.use", locked, details={"action": action})
    return locked


def _is_uuid(value) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True
