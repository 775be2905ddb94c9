"""Console tables of the tenancy app (``berth.tables.Table``), one line per record.

``RecordTable`` adds what the shared table has no room for: a stable row id (so HTMX can swap one
row), and extra cells rendered by a template (holdings bars, per-row buttons). Whether a row's
buttons show is answered once per row by ``access.can`` for the table's caller; the service
checks again when the button is pressed.
"""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal

from django.urls import reverse
from django.utils import timezone
from django.utils.timesince import timesince

from berth.tables import Column, Table, when
from tenancy import access
from tenancy.models import Role
from tenancy.models.contracts import CAPACITY_FIGURES
from tenancy.services.clients import key_action


class RecordTable(Table):
    extra_headers: tuple[str, ...] = ()
    extra_template: str = ""  # renders the extra <td>s of one row; gets ``row``, ``may`` and ``table``
    row_permission: str = ""  # the action the row's buttons need (``may`` in the extra template)
    row_prefix: str = "row"

    def __init__(self, rows, caller=None, empty_message: str | None = None, **context):
        rows = [self.prepare(row) for row in rows]
        super().__init__(rows, empty_message=empty_message)
        self.caller = caller
        self.context = context
        allowed = [bool(self.row_permission) and caller is not None and access.can(caller, self.row_permission, row)
                   for row in self.rows]
        self.records = [Record(row, line, may, f"{self.row_prefix}-{row.public_id}")
                        for row, line, may in zip(self.rows, self.lines, allowed)]

    def prepare(self, row):
        """Set what the extra template reads on a row (templates cannot call functions)."""
        return row

    @property
    def any_may(self) -> bool:
        return any(record.may for record in self.records)

    @property
    def show_extra(self) -> bool:
        """Extra cells show when there are any; button cells only when some row has a button."""
        return bool(self.extra_template) and (not self.row_permission or self.any_may)

    @property
    def colspan(self) -> int:
        return len(self.visible_columns) + (len(self.extra_headers) if self.show_extra else 0)

    def record_of(self, row) -> "Record":
        return next(record for record in self.records if record.row.pk == row.pk)


@dataclasses.dataclass(frozen=True)
class Record:
    row: object
    line: list
    may: bool
    dom_id: str


def _ago(value):
    return None if value is None else f"{timesince(value)} ago"


def _number(value):
    if value is None:
        return None
    return f"{value.normalize():f}" if isinstance(value, Decimal) else str(value)


def scope_link(scope) -> str:
    return reverse("tenancy:scope", args=[scope.public_id])


# The tree ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bar:
    """What a scope holds of one figure against its guarantee and limit (either may be unset)."""

    label: str
    unit: str
    held: Decimal
    guarantee: Decimal | None
    limit: Decimal | None

    @property
    def scale(self) -> Decimal | None:
        return self.limit or self.guarantee or None

    @property
    def held_percent(self) -> int:
        return _percent(self.held, self.scale)

    @property
    def guarantee_percent(self) -> int | None:
        return None if self.guarantee is None or not self.scale else _percent(self.guarantee, self.scale)

    @property
    def over(self) -> bool:
        return self.limit is not None and self.held >= self.limit and self.limit > 0

    @property
    def summary(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        parts = [f"{self.label}: {_number(self.held)}{unit} held"]
        parts.append(f"guarantee {_number(self.guarantee)}" if self.guarantee is not None else "no guarantee")
        parts.append(f"limit {_number(self.limit)}" if self.limit is not None else "no limit")
        return ", ".join(parts)

    @property
    def short(self) -> str:
        held = _number(self.held)
        if self.limit is not None:
            return f"{held}/{_number(self.limit)}"
        return f"{held} (g {_number(self.guarantee)})" if self.guarantee is not None else held


def _percent(value, scale) -> int:
    if not scale:
        return 0
    return max(0, min(100, int(value * 100 / scale)))


def bars(contract, held) -> list[Bar]:
    return [Bar(label, unit, getattr(held, stem),
                getattr(contract, f"{stem}_guarantee", None) if contract else None,
                getattr(contract, f"{stem}_limit", None) if contract else None)
            for stem, label, unit in CAPACITY_FIGURES]


def _indented(scope):
    # Depth shown by indentation (em spaces survive the one-line, clipped cell).
    return "\u2003" * scope.depth + scope.name


class ScopeTable(RecordTable):
    columns = (
        Column("Scope", _indented, link=scope_link),
        Column("Written", "written"),
        Column("Kind", lambda s: s.get_kind_display()),
    )
    extra_headers = tuple(label for _, label, _ in CAPACITY_FIGURES)
    extra_template = "tenancy/cells/bars.html"
    row_prefix = "scope"
    empty_message = "No organisations, teams or projects you can see."


# People ---------------------------------------------------------------------------------------------

class MembershipTable(RecordTable):
    columns = (
        Column("Person", "user.username"),
        Column("Scope", lambda m: m.scope.written, link=lambda m: scope_link(m.scope)),
        Column("Role", lambda m: m.get_role_display()),
        Column("Since", lambda m: when(m.created_at)),
    )
    extra_headers = ("",)
    extra_template = "tenancy/cells/membership_actions.html"
    row_permission = "change"
    row_prefix = "membership"
    empty_message = "No memberships you can see."
    roles = Role.choices


# Service clients and keys ---------------------------------------------------------------------------

def client_link(client) -> str:
    return reverse("tenancy:client", args=[client.public_id])


class ClientTable(RecordTable):
    columns = (
        Column("Name", "name", link=client_link),
        Column("Project", lambda c: c.project.path, link=lambda c: scope_link(c.project)),
        Column("Environment", lambda c: c.get_environment_display()),
        Column("Access", lambda c: c.get_access_display()),
        Column("Priority", lambda c: c.get_priority_display()),
        Column("Models", lambda c: "all" if c.all_models else ", ".join(c.allowed_models)),
        Column("Working keys", lambda c: getattr(c, "working_keys", None), numeric=True),
        Column("State", lambda c: "active" if c.is_active else "disabled"),
        Column("Description", "description"),
    )
    row_prefix = "client"
    empty_message = "No service clients you can see. A project's members create one (New service client) to give a program its own keys."


def key_state(credential) -> str:
    now = timezone.now()
    if credential.revoked_at is not None:
        return "revoked"
    if credential.expires_at is not None and credential.expires_at <= now:
        return "expired"
    if getattr(credential, "replaced_by", None) is not None:
        return f"rotated, works until {when(credential.expires_at)}" if credential.expires_at else "rotated"
    return "working"


class CredentialTable(RecordTable):
    columns = (
        Column("Key", "prefix"),
        Column("Name", "name"),
        Column("State", key_state),
        Column("Created", lambda c: when(c.created_at), sort="created_at"),
        Column("Created by", "created_by.username"),
        Column("Expires", lambda c: when(c.expires_at), sort="expires_at"),
        Column("Last used", lambda c: _ago(c.last_used_at), sort="last_used_at"),
        Column("Replaces", "replaces.prefix"),
    )
    extra_headers = ("",)
    extra_template = "tenancy/cells/key_actions.html"
    row_permission = "use"
    row_prefix = "key"
    empty_message = "No keys yet. A member of its project creates one (Create key); its secret is shown once."

    def __init__(self, rows, caller=None, **context):
        super().__init__(rows, caller=caller, **context)
        # Revoking takes a member; rotating mints a key, which for a management client takes an admin.
        for record in self.records:
            row = record.row
            row.may_rotate = row.may_rotate and caller is not None and access.can(caller, key_action(row.client), row)

    def prepare(self, credential):
        state = key_state(credential)
        credential.may_revoke = state not in ("revoked", "expired")
        credential.may_rotate = state == "working"
        return credential


# Contracts ------------------------------------------------------------------------------------------

def _figure(name):
    return lambda contract: _number(getattr(contract, name))


class ContractChainTable(RecordTable):
    """A scope's contract and its ancestors', nearest first: the limits that apply to it."""

    columns = (
        Column("Scope", lambda c: c.scope.written, link=lambda c: scope_link(c.scope)),
        *(Column(f"{label} {side}", _figure(f"{stem}_{side}"), numeric=True)
          for stem, label, _ in CAPACITY_FIGURES for side in ("guarantee", "limit")),
        Column("RPM", _figure("rpm_limit"), numeric=True),
        Column("TPM", _figure("tpm_limit"), numeric=True),
        Column("Concurrent", _figure("concurrency_limit"), numeric=True),
        Column("Tokens/day", _figure("daily_token_budget"), numeric=True),
        Column("Tokens/week", _figure("weekly_token_budget"), numeric=True),
        Column("Tokens/month", _figure("monthly_token_budget"), numeric=True),
        Column("Budget", lambda c: c.get_budget_mode_display()),
    )
    row_prefix = "contract"
    empty_message = "No contract here or above: nothing is guaranteed and nothing limits this scope but the fleet."


# Audit ----------------------------------------------------------------------------------------------

class AuditTable(RecordTable):
    columns = (
        Column("When", lambda e: timezone.localtime(e.at).strftime("%Y-%m-%d %H:%M:%S")),
        Column("Actor", "actor"),
        Column("Action", "action"),
        Column("Object", "object_repr"),
        Column("Scope", "scope_path"),
        Column("Address", "address"),
        Column("Details", lambda e: json.dumps(e.details, sort_keys=True) if e.details else None),
    )
    row_prefix = "event"
    empty_message = "No events match."
