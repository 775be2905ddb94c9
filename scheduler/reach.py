"""What of the fleet a caller may see, in one place.

The fleet's capacity — nodes, their states, accelerators, memory and engines — is everyone's to read:
it is what a tenant plans against. What lies in the model directories (paths, file lists) and reading
files by path are staff's: a file under the model roots may be behind another tenant's catalog entry.
Placement evidence is about a model, and a model belongs to a scope: a decision is read by those who
see its owner scope; one with no owner (a shared model, a stand-in, a scope since deleted) by staff.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from tenancy import access
from tenancy.errors import ScopeNotFound
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope


def sees_everything(caller: Any) -> bool:
    """Staff (the fleet's operators), superusers and Berth itself."""
    return access.is_superuser(caller) or bool(getattr(caller, "is_staff", False)
                                                and getattr(caller, "is_active", False))


def visible_scopes(caller: Any) -> QuerySet:
    scopes = Scope.objects.all()
    return scopes if sees_everything(caller) else access.visible_to(caller, scopes, "")


def visible_decisions(caller: Any, rows: QuerySet) -> QuerySet:
    """``rows`` (placement decisions) narrowed to those the caller may read."""
    return rows if sees_everything(caller) else access.visible_owned(caller, rows)


def resolve_owner(caller: Any, written: str | None) -> Scope | None:
    """The owner scope a caller names — its path as the policy writes it (``acme/ml``), ``kind:path``,
    a unique last element or its id — among the scopes the caller may see; one outside their reach is
    "no such scope" (404), exactly like one that does not exist. Empty: shared (None)."""
    text = (written or "").strip()
    if not text:
        return None
    try:
        return resolve_scope(text, visible_scopes(caller))
    except ScopeNotFound as error:
        raise ScopeNotFound(error.message, details={"field": "owner"}) from None
