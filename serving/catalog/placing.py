"""A catalog model's placement as a person changes it: always running (the minimum), at most under
load (the maximum), capacity class, idle timeout, pinned (always resident, never evicted), the
models that stand in for it (fallbacks), the model that drafts for it (speculative decoding), the
most tokens one request may generate (the gateway's cap) and owner.

The console card and the API's PATCH both call ``change``, so one set of rules holds for both:

* changing a model takes member (``use``) on its owner; a shared model is the administrators';
* moving it to another owner takes the same on the new one; making it shared, an administrator;
* the entry is checked whole (``validation``: max ≥ min, a known class or automatic, a timeout of
  at least a second or the default, an output cap of at least one token or none);
* fallbacks and the draft name models the catalog holds;
* a raised minimum must be one placement can meet (``room.check_scaling`` says why not); a pinned
  model wants at least one replica.

Every refusal that concerns a field names it in ``details["problems"]`` ([{field, message}]), as
the validation's refusals do.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from berth.errors import BerthError, InvalidInput
from serving.catalog import entries, room, validation
from serving.catalog.errors import InvalidModelEntry, ScalingRefused
from serving.models import ModelEntry
from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.errors import Forbidden
from tenancy.models import Scope
from tenancy.services.tree import resolve_scope

FIELDS = ("scaling_min", "scaling_max", "service_class", "idle_timeout_seconds", "pinned", "fallbacks", "draft",
          "max_output_tokens")
LABELS = {"scaling_min": "Always running", "scaling_max": "At most under load", "service_class": "Capacity class",
          "idle_timeout_seconds": "Idle timeout", "pinned": "Pinned", "fallbacks": "Fallbacks", "draft": "Draft model",
          "max_output_tokens": "Max output tokens", "owner": "Owner"}


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()  # ``owner=KEEP``: the owner stays as it is


def _with_field(error: BerthError, field: str) -> BerthError:
    details = error.details if isinstance(error.details, dict) else {"detail": error.details}
    error.details = {**details, "problems": [{"field": field, "message": error.message}]}
    return error


def may_change(caller: Any, entry: ModelEntry) -> bool:
    if entry.owner is None:
        return access.is_superuser(caller)
    return access.can(caller, "use", entry.owner)


def owners_for(caller: Any) -> list[Scope]:
    """The scopes the caller may give a model to (member or above there), as the owner select lists them."""
    visible = access.visible_to(caller, Scope.objects.all(), "")
    return [scope for scope in visible if access.can(caller, "use", scope)]


def resolve_owner(caller: Any, written: str | None) -> Scope | None:
    """The scope a person names — as written (``project:acme/ml/search``), its id, or its bare path as
    the API shows it — among those the caller may see. Empty: no owner (shared)."""
    text = (written or "").strip()
    if not text:
        return None
    try:
        return resolve_scope(text, access.visible_to(caller, Scope.objects.all(), ""))
    except BerthError as error:
        raise _with_field(error, "owner")


def require_change(actor: Actor, entry: ModelEntry) -> None:
    if may_change(actor, entry):
        return
    if entry.owner is None:
        raise Forbidden(f"{entry.name} is shared: only administrators change it.", details={"needs": "administrator"})
    access.require(actor, "view", entry.owner)  # outside the caller's reach: a 404, as everywhere
    raise Forbidden(f"Your role does not allow changing {entry.name}: it takes member (or above) of "
                    f"{entry.owner.written}.", details={"action": "use", "needs": "member"})


def _require_owner(actor: Actor, entry: ModelEntry, owner: Scope | None) -> None:
    if owner is None:
        if not access.is_superuser(actor):
            raise _with_field(Forbidden(f"Only administrators make {entry.name} shared (no owner).",
                                        details={"needs": "administrator"}), "owner")
    elif not access.can(actor, "use", owner):
        raise _with_field(Forbidden(f"Your role does not allow giving {entry.name} to {owner.written}: it takes "
                                    f"member (or above) there.", details={"action": "use", "needs": "member"}),
                          "owner")


def _require_known(values: dict[str, Any]) -> None:
    """Fallbacks and the draft must name models the catalog holds (a typo is refused, not kept)."""
    named = [(field, name) for field in ("fallbacks", "draft") if field in values
             for name in ([values[field]] if field == "draft" else values[field]) if name]
    known = set(ModelEntry.objects.filter(name__in=[name for _, name in named]).values_list("name", flat=True))
    problems = [{"field": field, "message": f"No model named {name} in the catalog."}
                for field, name in named if name not in known]
    if problems:
        raise InvalidModelEntry("; ".join(p["message"] for p in problems), details={"problems": problems})


def change(actor: Actor, entry: ModelEntry, values: dict[str, Any], *, owner: Any = KEEP) -> ModelEntry:
    """Change the placement fields in ``values`` (any of ``FIELDS``) and, unless ``KEEP``, the owner.

    ``entry`` should come with its deployments (``catalog.queries.held_entries``) so that what runs
    counts toward a raised minimum. Refused whole — nothing changes — when any rule says no."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise InvalidInput(f"Only {', '.join(FIELDS)} and owner change here, not {', '.join(unknown)}.",
                           details={"problems": [{"field": f, "message": "Not changed here."} for f in unknown]})
    require_change(actor, entry)
    moving = owner is not KEEP and owner != entry.owner
    merged = {**entries.as_fields(entry), **values}
    validation.require_valid(merged)
    _require_known(values)
    if moving:
        _require_owner(actor, entry, owner)
    before = {field: getattr(entry, field) for field in FIELDS}
    previous = entry.owner
    if moving:
        entry.owner = owner  # the room is asked as the new owner's (its quotas), and saved with the fields
    try:
        try:
            room.check_scaling(entry, max(merged["scaling_min"], 1 if merged["pinned"] else 0), merged["scaling_max"])
        except ScalingRefused as refused:
            raise _with_field(refused, "pinned" if merged["pinned"] and not merged["scaling_min"] else "scaling_min")
        with transaction.atomic():
            entry = entries.save_entry(actor, values, entry=entry)
            changed = {field: {"from": before[field], "to": getattr(entry, field)} for field in FIELDS
                       if before[field] != getattr(entry, field)}
            if moving:
                changed["owner"] = {"from": previous.written if previous else None,
                                    "to": owner.written if owner else None}
            if changed:  # scoped to the previous owner: its log shows a model that left it
                audit.record(actor, "catalog.model.placement", entry, scope=previous,
                             details={"name": entry.name, "changes": changed})
    except BaseException:
        entry.owner = previous
        raise
    return entry
