"""Who may do what, in one place.

A caller is a person (``User``) or a service client acting through a management key. A person's
role on a scope is the highest role of their memberships on that scope or any ancestor: a role holds
for everything below it. A management client acts as an admin of its own project, but never above the
role that the person who gave it management access holds there now. Superusers may do everything.

``can`` answers one question for one object; ``visible_to`` narrows any queryset of tenancy-scoped
rows to what the caller may see; ``require`` turns a "no" into the right error — a 404 when the
caller may not even see the object (never confirm that it exists), a 403 when they may see it but
not do this.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import Q, QuerySet

from berth.errors import NotFound
from tenancy.audit import scope_of
from tenancy.errors import Forbidden
from tenancy.models import ROLE_RANK, Membership, Role, Scope, ServiceClient

# The least role each action needs.
ACTIONS = {
    "view": Role.VIEWER,     # read the scope and everything in it
    "use": Role.MEMBER,      # service clients and keys of its projects; ask for approvals
    "change": Role.ADMIN,    # child scopes, names, contracts, memberships below owner
    "decide": Role.ADMIN,    # approve or reject what others asked for
    "own": Role.OWNER,       # delete scopes, grant or remove ownership
}


def _principal(caller: Any):
    """Accept a User, a ServiceClient, or anything with ``.user``/``.client`` (an audit Actor)."""
    if hasattr(caller, "client") and hasattr(caller, "user") and not hasattr(caller, "memberships"):
        return caller.client if caller.client is not None else caller.user
    return caller


def is_superuser(caller: Any) -> bool:
    # Berth itself (an Actor with neither user nor client: reconcile loops, manage.py on the server)
    # may do everything; only code constructs such an actor.
    if getattr(caller, "system", "") and getattr(caller, "user", None) is None and getattr(caller, "client", None) is None:
        return True
    principal = _principal(caller)
    return bool(getattr(principal, "is_superuser", False) and getattr(principal, "is_active", False))


def roles(caller: Any) -> dict[str, str]:
    """{scope path: role} of the caller's own grants (not inherited), one query."""
    principal = _principal(caller)
    if isinstance(principal, ServiceClient):
        return _client_roles(principal)
    if principal is None or not getattr(principal, "is_authenticated", False) or not principal.is_active:
        return {}
    cache = getattr(principal, "_berth_roles", None)
    if cache is None:
        cache = dict(Membership.objects.filter(user=principal).values_list("scope__path", "role"))
        principal._berth_roles = cache  # per request: the user object lives as long as the request
    return cache


def _client_roles(client: ServiceClient) -> dict[str, str]:
    if not (client.is_active and client.may_manage):
        return {}
    # Cached on the instance (one per request, as for people), keyed by what the answer rests on so an
    # update of this very instance is not answered from before it.
    key = (client.access, client.is_active, client.project_id, client.granted_by_id)
    cached = getattr(client, "_berth_roles", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    role = Role.ADMIN
    if client.granted_by_id is not None:
        # Never above its granter's role now: a member cannot make a client that acts as an admin, and
        # demoting or removing the granter demotes the client too.
        granter = get_user_model().objects.filter(pk=client.granted_by_id).first()
        held = role_on(granter, client.project) if granter is not None else None
        role = held if held is None or ROLE_RANK[held] < ROLE_RANK[Role.ADMIN] else Role.ADMIN
    grants = {client.project.path: role} if role else {}
    client._berth_roles = (key, grants)
    return grants


def forget_roles(caller: Any) -> None:
    principal = _principal(caller)
    if hasattr(principal, "_berth_roles"):
        del principal._berth_roles


def role_on(caller: Any, scope: Scope) -> str | None:
    if is_superuser(caller):
        return Role.OWNER
    grants = roles(caller)
    best = None
    for path in scope.ancestor_paths():
        role = grants.get(path)
        if role and (best is None or ROLE_RANK[role] > ROLE_RANK[best]):
            best = role
    return best


def can(caller: Any, action: str, obj: Any) -> bool:
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    if is_superuser(caller):
        return True
    scope = scope_of(obj)
    if scope is None:
        return False
    role = role_on(caller, scope)
    return role is not None and ROLE_RANK[role] >= ROLE_RANK[ACTIONS[action]]


def require(caller: Any, action: str, obj: Any) -> None:
    if not can(caller, "view", obj):
        raise NotFound("No such object, or it is outside your reach.")
    if not can(caller, action, obj):
        raise Forbidden(f"Your role does not allow '{action}' here.",
                        details={"action": action, "needs": ACTIONS[action]})


def subtree(path: str, field: str = "path") -> Q:
    """Rows whose ``field`` (a scope path) is ``path`` or anywhere below it."""
    return Q(**{field: path}) | Q(**{f"{field}__startswith": path + "/"})


def visible_to(caller: Any, queryset: QuerySet, scope_field: str = "scope") -> QuerySet:
    """Narrow ``queryset`` to rows whose scope (``scope_field``, a path to a Scope) lies at or below
    a scope where the caller holds any role. ``scope_field=""`` when the rows are Scopes."""
    return visible_by_path(caller, queryset, f"{scope_field}__path" if scope_field else "path")


def visible_owned(caller: Any, queryset: QuerySet, field: str = "owner") -> QuerySet:
    """Rows that belong to a scope (``field``) the caller may see; rows of no scope are Berth's own
    (placement's replicas, shared fetches), for superusers only."""
    if is_superuser(caller):
        return queryset
    return visible_to(caller, queryset.filter(**{f"{field}__isnull": False}), field)


def visible_by_path(caller: Any, queryset: QuerySet, field: str = "scope_path") -> QuerySet:
    """``visible_to`` for rows that keep their scope's path (``field``) rather than a link to it, as
    audit events and usage records do: the scope may be gone since, the path stays."""
    if is_superuser(caller):
        return queryset
    grants = roles(caller)
    if not grants:
        return queryset.none()
    condition = Q()
    for path in grants:
        condition |= subtree(path, field)
    return queryset.filter(condition)
