"""The organisation tree: create, rename, delete scopes, and read a scope as people write it."""

from __future__ import annotations

import uuid

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from tenancy import access, audit
from tenancy.audit import Actor
from tenancy.errors import AlreadyExists, AmbiguousScope, Forbidden, InUse, InvalidTree, ScopeNotFound, ScopeSyntax, UnknownScopeKind
from tenancy.models import Scope
from tenancy.models.tree import slug_validator

PARENT_KIND = {Scope.Kind.ORG: None, Scope.Kind.TEAM: Scope.Kind.ORG, Scope.Kind.PROJECT: Scope.Kind.TEAM}


def resolve_scope(written: str, queryset=None) -> Scope:
    """A scope from how people write it: an id; ``kind:full/path``; ``kind:last-element`` when that
    last element is unique; or the same without the kind (``acme/ml``, ``search``), among scopes of
    any kind. Only ``queryset`` is searched (the scopes the caller may see), so the candidates an
    ambiguous name lists are ones the caller may see."""
    queryset = Scope.objects.all() if queryset is None else queryset
    text = (written or "").strip()
    if not text:
        raise ScopeSyntax("Write a scope as org:acme, team:acme/ml, project:acme/ml/search or its id.")
    by_id = _uuid(text)
    if by_id is not None:
        return _one(queryset.filter(public_id=by_id), text)
    kind, separator, rest = text.partition(":")
    if separator:
        kind = kind.strip().lower()
        if kind not in Scope.Kind.values:
            raise UnknownScopeKind(f"Unknown scope kind {kind!r}; use org, team or project.",
                                   details={"kinds": list(Scope.Kind.values)})
        queryset = queryset.filter(kind=kind)
    else:
        rest = text  # no kind: any kind
    rest = rest.strip().strip("/").lower()
    by_id = _uuid(rest)
    if by_id is not None:
        return _one(queryset.filter(public_id=by_id), text)
    exact = queryset.filter(path=rest).first()
    if exact is not None:
        return exact
    if rest and "/" not in rest:
        candidates = list(queryset.filter(slug=rest).order_by("path")[:20])
        if len(candidates) == 1:
            return candidates[0]
        if len(candidates) > 1:
            written_candidates = [c.written for c in candidates]
            raise AmbiguousScope(f"{text!r} matches {len(candidates)} scopes: {', '.join(written_candidates)}.",
                                 details={"candidates": written_candidates})
    raise ScopeNotFound(f"No scope {text!r}, or it is outside your reach.")


def _uuid(text: str):
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def _one(queryset, text):
    scope = queryset.first()
    if scope is None:
        raise ScopeNotFound(f"No scope {text!r}, or it is outside your reach.")
    return scope


def create_scope(actor: Actor, kind: str, slug: str, name: str = "", parent: Scope | None = None) -> Scope:
    if kind not in PARENT_KIND:
        raise UnknownScopeKind(f"Unknown scope kind {kind!r}; use org, team or project.")
    expected = PARENT_KIND[kind]
    if expected is None and parent is not None:
        raise InvalidTree("An organisation is a root: it has no parent.")
    if expected is not None and (parent is None or parent.kind != expected):
        raise InvalidTree(f"A {Scope.Kind(kind).label.lower()} belongs to an {expected.label.lower()}"
                          if expected == Scope.Kind.ORG else
                          f"A {Scope.Kind(kind).label.lower()} belongs to a {expected.label.lower()}.",
                          details={"parent": f"must be a {expected}"})
    slug = (slug or "").strip().lower()
    try:
        slug_validator(slug)
    except ValidationError as exc:
        raise InvalidTree(f"Slug {slug!r}: {exc.messages[0]}", details={"slug": exc.messages}) from None
    if parent is None:
        if not access.is_superuser(actor):
            raise Forbidden("Only an administrator of Berth creates organisations.")
    else:
        access.require(actor, "change", parent)
    path = f"{parent.path}/{slug}" if parent else slug
    try:
        with transaction.atomic():
            scope = Scope.objects.create(kind=kind, slug=slug, name=(name or slug).strip()[:200], parent=parent,
                                         path=path)
            audit.record(actor, "scope.create", scope, details={"kind": kind, "path": path, "name": scope.name})
    except IntegrityError:
        raise AlreadyExists(f"{kind}:{path} already exists.") from None
    return scope


def rename_scope(actor: Actor, scope: Scope, name: str) -> Scope:
    access.require(actor, "change", scope)
    name = (name or "").strip()
    if not name or len(name) > 200:
        raise InvalidTree("A name has 1 to 200 characters.", details={"name": "1-200 characters"})
    with transaction.atomic():
        before = scope.name
        scope.name = name
        scope.save(update_fields=["name"])
        audit.record(actor, "scope.rename", scope, details={"from": before, "to": name})
    return scope


def delete_scope(actor: Actor, scope: Scope) -> None:
    access.require(actor, "own", scope)
    with transaction.atomic():
        locked = Scope.objects.select_for_update().get(pk=scope.pk)
        blockers = {"children": locked.children.count(), "service clients": locked.clients.count(),
                    "reservations": locked.reservations.count()}
        blocking = {k: v for k, v in blockers.items() if v}
        if blocking:
            raise InUse(f"{scope.written} still has " + ", ".join(f"{v} {k}" for k, v in blocking.items()) + ".",
                        details=blocking)
        audit.record(actor, "scope.delete", locked, details={"path": locked.path})
        locked.delete()
