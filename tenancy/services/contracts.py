"""Capacity contracts: guarantees and limits per scope, what a scope holds, and whether more fits.

Reads here are on the scheduler's and gateway's paths, so each is one or two indexed queries:
ancestors are the prefixes of a scope's path, a subtree is a path prefix.
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.db.models import Sum
from django.db.models.functions import Length

from tenancy import access, audit
from tenancy.audit import SYSTEM, Actor
from tenancy.errors import CapacityExceeded, InvalidContract
from tenancy.models import Contract, Reservation, Scope
from tenancy.models.contracts import CAPACITY_FIGURES, RATE_FIGURES
from tenancy.services import approvals

CAPACITY = tuple(stem for stem, _, _ in CAPACITY_FIGURES)
LABEL = {stem: label for stem, label, _ in CAPACITY_FIGURES + RATE_FIGURES}
UNIT = {stem: unit for stem, _, unit in CAPACITY_FIGURES + RATE_FIGURES}
LIMIT_FIELDS = tuple(f"{stem}_limit" for stem in CAPACITY) + tuple(stem for stem, _, _ in RATE_FIGURES)
FIELDS = tuple(f"{stem}_{side}" for stem in CAPACITY for side in ("guarantee", "limit")) \
    + tuple(stem for stem, _, _ in RATE_FIGURES) + ("budget_mode",)


@dataclasses.dataclass(frozen=True)
class Holdings:
    gpu_memory_gib: Decimal = Decimal(0)
    gpus: Decimal = Decimal(0)
    cores: Decimal = Decimal(0)


@dataclasses.dataclass(frozen=True)
class Refusal:
    scope: str  # written, e.g. org:acme
    figure: str
    held: Decimal
    asked: Decimal
    limit: Decimal
    message: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    refusals: tuple[Refusal, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.refusals


def _fmt(value: Decimal, stem: str) -> str:
    number = f"{value.normalize():f}" if isinstance(value, Decimal) else str(value)
    unit = UNIT.get(stem, "")
    return f"{number} {unit}".rstrip() if unit == "GiB" else number


def _clean(figures: dict) -> dict:
    unknown = set(figures) - set(FIELDS)
    problems = {name: "unknown figure" for name in sorted(unknown)}
    cleaned = {}
    for name, value in figures.items():
        if name in unknown:
            continue
        if name == "budget_mode":
            if value not in Contract.BudgetMode.values:
                problems[name] = "hard or soft"
            else:
                cleaned[name] = value
            continue
        if value is None or value == "":
            cleaned[name] = None
            continue
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            problems[name] = "a number, or empty for none"
            continue
        if number < 0 or not number.is_finite():
            problems[name] = "zero or more"
        elif name in {stem for stem, _, _ in RATE_FIGURES} and number != number.to_integral_value():
            problems[name] = "a whole number"
        else:
            cleaned[name] = int(number) if name in {s for s, _, _ in RATE_FIGURES} else number
    if problems:
        raise InvalidContract("The contract has invalid figures.", details=problems)
    return cleaned


def _figures(contract: Contract | None) -> dict:
    if contract is None:
        return {name: None for name in FIELDS if name != "budget_mode"} | {"budget_mode": Contract.BudgetMode.HARD}
    return {name: getattr(contract, name) for name in FIELDS}


GUARANTEE_FIELDS = tuple(f"{stem}_guarantee" for stem in CAPACITY)
BUDGET_FIELDS = ("daily_token_budget", "weekly_token_budget", "monthly_token_budget")


def _raised_limits(before: dict, after: dict) -> list[str]:
    """What the change loosens, each of which needs an approval: a limit raised or removed (an unset
    limit is no limit at all); a budget that refused and now only warns (hard to soft while a budget
    is set); a guarantee raised or set (a guarantee is a claim on capacity its siblings share)."""
    raised = []
    for name in LIMIT_FIELDS:
        old, new = before.get(name), after.get(name)
        if old is not None and (new is None or Decimal(new) > Decimal(old)):
            raised.append(name)
    if before.get("budget_mode") == Contract.BudgetMode.HARD and after.get("budget_mode") == Contract.BudgetMode.SOFT \
            and any(before.get(name) is not None for name in BUDGET_FIELDS):
        raised.append("budget_mode")
    for name in GUARANTEE_FIELDS:
        old, new = before.get(name), after.get(name)
        if new is not None and (old is None or Decimal(new) > Decimal(old)):
            raised.append(name)
    return raised


def _validate_tree(scope: Scope, after: dict) -> None:
    problems = {}
    for stem in CAPACITY:
        guarantee, limit = after.get(f"{stem}_guarantee"), after.get(f"{stem}_limit")
        if guarantee is not None and limit is not None and guarantee > limit:
            problems[f"{stem}_guarantee"] = (f"{scope.written}: the {LABEL[stem]} guarantee ({_fmt(guarantee, stem)}) "
                                             f"exceeds its limit ({_fmt(limit, stem)})")
    # Children's guarantees never add up to more than the parent's guarantee.
    if scope.parent_id:
        parent_contract = Contract.objects.filter(scope_id=scope.parent_id).first()
        siblings = Contract.objects.filter(scope__parent_id=scope.parent_id).exclude(scope=scope)
        for stem in CAPACITY:
            field = f"{stem}_guarantee"
            parent_guarantee = getattr(parent_contract, field, None) if parent_contract else None
            if parent_guarantee is None or after.get(field) is None:
                continue
            total = (siblings.aggregate(t=Sum(field))["t"] or Decimal(0)) + after[field]
            if total > parent_guarantee:
                problems[field] = (f"the {LABEL[stem]} guarantees under {scope.parent.written} would add up to "
                                   f"{_fmt(total, stem)}, more than its own guarantee of {_fmt(parent_guarantee, stem)}")
    children = Contract.objects.filter(scope__parent=scope)
    for stem in CAPACITY:
        field = f"{stem}_guarantee"
        if after.get(field) is None:
            continue
        total = children.aggregate(t=Sum(field))["t"]
        if total is not None and total > after[field]:
            problems[field] = (f"the {LABEL[stem]} guarantees of {scope.written}'s children add up to "
                               f"{_fmt(total, stem)}, more than the {_fmt(after[field], stem)} asked for")
    if problems:
        raise InvalidContract("; ".join(sorted(problems.values())) + ".", details=problems)


def contract_evidence(scope: Scope, before: dict, after: dict) -> dict:
    """What an approval to raise a limit rests on: the contract as it is and as proposed."""
    return {"scope": scope.written, "current": {k: _plain(v) for k, v in before.items()},
            "proposed": {k: _plain(v) for k, v in after.items()}}


def raise_limit_evidence(scope: Scope, **figures) -> dict:
    """The evidence an approval for setting ``figures`` on ``scope``'s contract rests on, rebuilt
    from the current state exactly as ``set_contract`` will rebuild it when carrying the change out.
    Refused when the change raises no limit (it needs no approval)."""
    changes = _clean(figures)
    before = _figures(Contract.objects.filter(scope=scope).first())
    after = before | changes
    if not _raised_limits(before, after):
        raise InvalidContract("This change raises or removes no limit, softens no budget and raises no guarantee: "
                              "it needs no approval.", details={"limits": "none raised"})
    return contract_evidence(scope, before, after)


def _plain(value):
    """One spelling per amount (8, 8.0 and Decimal("8.00") are all "8"), so evidence compares exactly."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float, Decimal)):
        return f"{Decimal(str(value)).normalize():f}"
    return value


def set_contract(actor: Actor, scope: Scope, approval=None, **figures) -> Contract:
    """Set some figures of ``scope``'s contract (others keep their values). Raising or removing a
    limit, softening a hard budget, and raising or setting a guarantee need an approval."""
    access.require(actor, "change", scope)
    changes = _clean(figures)
    with transaction.atomic():
        # Lock the parent and the scope: two concurrent changes under one parent cannot both pass
        # the sum-of-guarantees check.
        # Top down, as ``reserve`` does, so the two never wait on each other in opposite orders.
        list(Scope.objects.select_for_update().filter(pk__in=[p for p in (scope.pk, scope.parent_id) if p])
             .order_by("path"))
        contract = Contract.objects.filter(scope=scope).first()
        before = _figures(contract)
        after = before | changes
        _validate_tree(scope, after)
        if _raised_limits(before, after):
            approvals.consume(actor, "contract.raise_limit", scope, scope, contract_evidence(scope, before, after),
                              approval)
        contract = contract or Contract(scope=scope)
        for name, value in after.items():
            setattr(contract, name, value)
        contract.save()
        audit.record(actor, "contract.set", contract, details={
            "changed": {k: {"from": _plain(before[k]), "to": _plain(after[k])} for k in changes
                        if before[k] != after[k]}})
    return contract


def limit_chain(scope: Scope) -> list[Contract]:
    """The contracts of ``scope`` and its ancestors, nearest first (one query)."""
    return list(Contract.objects.select_related("scope").filter(scope__path__in=scope.ancestor_paths())
                .order_by(-Length("scope__path")))


def visible_chain(caller, scope: Scope) -> list[Contract]:
    """``limit_chain`` as ``caller`` may read it: only contracts of scopes they may view, as a direct
    read of each contract would answer (the console and the API show the same)."""
    return [contract for contract in limit_chain(scope) if access.can(caller, "view", contract.scope)]


def holdings(scope: Scope) -> Holdings:
    """What ``scope`` and everything below it hold now (one query)."""
    totals = Reservation.objects.filter(access.subtree(scope.path, "scope_path")).aggregate(**{stem: Sum(stem) for stem in CAPACITY})
    return Holdings(**{stem: totals[stem] or Decimal(0) for stem in CAPACITY})


def holdings_by_path(paths: list[str]) -> dict[str, Holdings]:
    """Holdings of many scopes at once, for pages showing a tree (one query)."""
    totals = {path: {stem: Decimal(0) for stem in CAPACITY} for path in paths}
    rows = Reservation.objects.values("scope_path").annotate(**{stem: Sum(stem) for stem in CAPACITY})
    for row in rows:
        for path in paths:
            if row["scope_path"] == path or row["scope_path"].startswith(path + "/"):
                for stem in CAPACITY:
                    totals[path][stem] += row[stem] or 0
    return {path: Holdings(**values) for path, values in totals.items()}


def check_addition(scope: Scope, **asked) -> Verdict:
    """Whether adding ``asked`` (gpu_memory_gib=, gpus=, cores=) under ``scope`` stays within every
    limit on its chain; each refusal names the scope and the figure."""
    unknown = set(asked) - set(CAPACITY)
    if unknown:
        raise InvalidContract(f"Unknown figures: {', '.join(sorted(unknown))}.", details={"allowed": list(CAPACITY)})
    amounts = {stem: Decimal(str(asked.get(stem) or 0)) for stem in CAPACITY}
    chain = [c for c in limit_chain(scope) if any(getattr(c, f"{s}_limit") is not None for s in CAPACITY)]
    held = holdings_by_path([c.scope.path for c in chain]) if chain else {}
    refusals = []
    for contract in chain:
        for stem in CAPACITY:
            limit = getattr(contract, f"{stem}_limit")
            if limit is None or not amounts[stem]:
                continue
            now = getattr(held[contract.scope.path], stem)
            if now + amounts[stem] > limit:
                refusals.append(Refusal(
                    scope=contract.scope.written, figure=stem, held=now, asked=amounts[stem], limit=limit,
                    message=(f"{contract.scope.written} is at its {LABEL[stem]} limit ({_fmt(now, stem)} of "
                             f"{_fmt(limit, stem).split()[0]} held; {_fmt(amounts[stem], stem)} more asked)")))
    return Verdict(tuple(refusals))


def reserve(scope: Scope, holder: str, *, actor: Actor = SYSTEM, **amounts) -> Reservation:
    """Record that ``holder`` (e.g. ``replica:<id>``) holds ``amounts`` against ``scope``, if every
    limit on the chain allows it. The chain's scopes are locked (top down) so two reservations
    cannot both take the last of a limit."""
    with transaction.atomic():
        list(Scope.objects.select_for_update().filter(path__in=scope.ancestor_paths()).order_by("path"))
        verdict = check_addition(scope, **amounts)
        if not verdict.fits:
            first = verdict.refusals[0]
            raise CapacityExceeded(first.message + ".", details={"refusals": [
                {"scope": r.scope, "figure": r.figure, "held": _plain(r.held), "asked": _plain(r.asked),
                 "limit": _plain(r.limit)} for r in verdict.refusals]})
        reservation = Reservation.objects.create(scope=scope, scope_path=scope.path, holder=holder,
                                                 **{stem: Decimal(str(amounts.get(stem) or 0)) for stem in CAPACITY})
        audit.record(actor, "reservation.take", reservation, details={"holder": holder, **{
            stem: _plain(getattr(reservation, stem)) for stem in CAPACITY}}, scope=scope)
    return reservation


def release(holder: str, *, actor: Actor = SYSTEM) -> bool:
    with transaction.atomic():
        reservation = Reservation.objects.select_for_update().select_related("scope").filter(holder=holder).first()
        if reservation is None:
            return False
        audit.record(actor, "reservation.release", reservation, details={"holder": holder}, scope=reservation.scope)
        reservation.delete()
    return True
