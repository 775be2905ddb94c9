"""Memberships: a role for a person on a scope, holding for everything below it."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.errors import AlreadyExists, InvalidTree, LastOwner
from tenancy.models import Membership, Role, Scope


def _check_role(role: str) -> None:
    if role not in Role.values:
        raise InvalidTree(f"Unknown role {role!r}; use owner, admin, member or viewer.",
                          details={"roles": list(Role.values)})


def _require_grant(actor: Actor, scope: Scope, role: str) -> None:
    # Admins manage memberships; only owners make or unmake owners.
    access.require(actor, "own" if role == Role.OWNER else "change", scope)


def add_member(actor: Actor, scope: Scope, user, role: str) -> Membership:
    _check_role(role)
    _require_grant(actor, scope, role)
    try:
        with transaction.atomic():
            membership = Membership.objects.create(user=user, scope=scope, role=role)
            audit.record(actor, "membership.add", membership, details={"user": user.get_username(), "role": role})
    except IntegrityError:
        raise AlreadyExists(f"{user.get_username()} already has a role on {scope.written}; change it instead.") from None
    access.forget_roles(user)
    return membership


def _keep_an_owner(membership: Membership) -> None:
    """Refuse to take away the last owner membership of an organisation: no one could then grant or
    remove ownership, or delete it. Call inside the change's transaction: the org's owner memberships
    are locked, so two owners removing each other at once cannot both pass."""
    if membership.scope.kind != Scope.Kind.ORG:
        return
    owners = list(Membership.objects.select_for_update().filter(scope_id=membership.scope_id, role=Role.OWNER)
                  .order_by("pk").values_list("pk", flat=True))
    if membership.pk in owners and len(owners) == 1:
        raise LastOwner(f"{membership.user.get_username()} is the last owner of {membership.scope.written}: "
                        "make someone else an owner first.", details={"scope": membership.scope.written})


def change_role(actor: Actor, membership: Membership, role: str) -> Membership:
    _check_role(role)
    _require_grant(actor, membership.scope, membership.role)
    _require_grant(actor, membership.scope, role)
    with transaction.atomic():
        if role != Role.OWNER:
            _keep_an_owner(membership)
        before = membership.role
        membership.role = role
        membership.save(update_fields=["role"])
        audit.record(actor, "membership.change", membership, details={"user": membership.user.get_username(),
                                                                       "from": before, "to": role})
    access.forget_roles(membership.user)
    return membership


def remove_member(actor: Actor, membership: Membership) -> None:
    _require_grant(actor, membership.scope, membership.role)
    with transaction.atomic():
        _keep_an_owner(membership)
        audit.record(actor, "membership.remove", membership, details={"user": membership.user.get_username(),
                                                                       "role": membership.role})
        membership.delete()
    access.forget_roles(membership.user)


def find_user(username: str):
    User = get_user_model()
    user = User.objects.filter(username__iexact=(username or "").strip()).first()
    if user is None:
        raise InvalidTree(f"No user {username!r}.", details={"user": "unknown"})
    return user
