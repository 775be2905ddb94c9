"""The audit log's one writer. Every service that changes state calls ``record`` inside the same
transaction as the change, so an event exists exactly when the change does."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from django.db import models

from tenancy.models import AuditEvent, Scope, ServiceClient

# Keys whose values never enter an event, whatever a caller passes.
_SECRET_KEY = re.compile(r"secret|password|plaintext|pepper|api_key|^key$|authorization", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Actor:
    """Who acts: a person, a service client through its key, or Berth itself."""

    user: Any = None
    client: ServiceClient | None = None
    address: str | None = None
    system: str = ""

    @classmethod
    def from_request(cls, request) -> "Actor":
        principal = getattr(request, "user", None)
        client = principal if isinstance(principal, ServiceClient) else None
        user = principal if client is None and getattr(principal, "is_authenticated", False) else None
        return cls(user=user, client=client, address=request.META.get("REMOTE_ADDR") or None)

    @property
    def written(self) -> str:
        if self.user is not None:
            return f"user:{self.user.get_username()}"
        if self.client is not None:
            return f"client:{self.client}"
        return f"system:{self.system or 'berth'}"


SYSTEM = Actor(system="berth")


def scope_of(obj: Any) -> Scope | None:
    """The tree node an object belongs to (for filtering the log by scope)."""
    if isinstance(obj, Scope):
        return obj
    for attribute in ("scope", "project"):
        value = getattr(obj, attribute, None)
        if isinstance(value, Scope):
            return value
    client = getattr(obj, "client", None)
    if isinstance(client, ServiceClient):
        return client.project
    return None


def scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("[redacted]" if _SECRET_KEY.search(str(k)) else scrub(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # Decimals, datetimes, UUIDs: as text


def record(actor: Actor, action: str, obj: Any, *, details: dict | None = None,
           scope: Scope | None = None) -> AuditEvent:
    scope = scope or scope_of(obj)
    if isinstance(obj, models.Model):
        object_type = obj._meta.label_lower
        object_id = str(getattr(obj, "public_id", None) or obj.pk or "")
    else:
        object_type, object_id = type(obj).__name__.lower(), ""
    return AuditEvent.objects.create(
        actor_user=actor.user, actor_client=actor.client, actor=actor.written, action=action,
        object_type=object_type, object_id=object_id, object_repr=str(obj)[:300],
        scope=scope, scope_path=scope.path if scope else "", details=scrub(details or {}),
        address=actor.address,
    )
