"""Service clients and their API keys: create, authenticate, revoke, rotate."""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from tenancy import access, audit, events, keys
from tenancy.audit import Actor
from tenancy.errors import (AlreadyExists, ApiKeyExpired, ApiKeyRevoked, ClientDisabled, InvalidApiKey, InvalidTree,
                            MalformedAuthorization)
from tenancy.models import Credential, Scope, ServiceClient
from tenancy.services import approvals

CLIENT_FIELDS = ("description", "all_models", "allowed_models", "environment", "access", "rpm_limit", "tpm_limit",
                 "concurrency_limit", "priority", "is_active")
LAST_USED_RESOLUTION = timedelta(minutes=1)
MAX_OVERLAP = timedelta(days=30)


def _validate_client(fields: dict) -> dict:
    unknown = set(fields) - set(CLIENT_FIELDS)
    problems = {name: "unknown field" for name in unknown}
    choices = {"environment": ServiceClient.Environment, "access": ServiceClient.Access,
               "priority": ServiceClient.Priority}
    for name, enum in choices.items():
        if name in fields and fields[name] not in enum.values:
            problems[name] = f"one of {', '.join(enum.values)}"
    for name in ("rpm_limit", "tpm_limit", "concurrency_limit"):
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems[name] = "a whole number of at least 1, or null for no limit of the client's own"
    if "allowed_models" in fields:
        models = fields["allowed_models"]
        if not isinstance(models, list) or not all(isinstance(m, str) and m.strip() for m in models):
            problems["allowed_models"] = "a list of model names"
    if problems:
        raise InvalidTree("The service client is invalid.", details=problems)
    return fields


def _manages(access_value: str) -> bool:
    return access_value in (ServiceClient.Access.MANAGEMENT, ServiceClient.Access.BOTH)


def _granter(actor: Actor):
    """Whose role caps a management client that ``actor`` makes: the person acting, or, for a
    management client acting, its own granter (so a chain of clients never climbs above one person)."""
    if actor.user is not None:
        return actor.user
    return actor.client.granted_by if actor.client is not None else None  # None: Berth itself


def key_action(client: ServiceClient) -> str:
    """What a key of ``client`` takes to mint or rotate: whoever holds a management key acts with the
    client's role, so it takes that role (admin) to get one; an inference key takes a member."""
    return "change" if client.may_manage else "use"


def create_client(actor: Actor, project: Scope, name: str, **fields) -> ServiceClient:
    if project.kind != Scope.Kind.PROJECT:
        raise InvalidTree(f"Service clients belong to projects; {project.written} is not one.")
    access.require(actor, "use", project)
    if _manages(fields.get("access")):
        # A management client acts as an admin of its project: only an admin gives one.
        access.require(actor, "change", project)
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise InvalidTree("A service client needs a name of 1 to 100 characters.", details={"name": "1-100 characters"})
    _validate_client(fields)
    granted_by = _granter(actor) if _manages(fields.get("access")) else None
    try:
        with transaction.atomic():
            client = ServiceClient.objects.create(project=project, name=name, granted_by=granted_by, **fields)
            audit.record(actor, "client.create", client, details={"name": name, **fields})
    except IntegrityError:
        raise AlreadyExists(f"{project.path} already has a client named {name!r}.") from None
    return client


def update_client(actor: Actor, client: ServiceClient, **fields) -> ServiceClient:
    """Change what a client may do. Whatever touches management access (giving it, or changing a
    client that has it) takes an admin. Moving a client into production revokes every key it holds:
    they were minted without the approval a production key needs (new ones need it as usual); so does
    giving it management access (its keys may have been minted by a member, for inference)."""
    access.require(actor, "use", client)
    with transaction.atomic():
        # Locked, so a key minted or rotated concurrently either sees the new state or is revoked with
        # the others (create_credential and rotate_credential lock the client too).
        current = ServiceClient.objects.select_for_update().get(pk=client.pk)
        if current.may_manage or _manages(fields.get("access")):
            access.require(actor, "change", current)
        _validate_client(fields)
        # Every key a gateway may trust now: what it knows of each (active, models, limits) goes stale,
        # and some may be revoked below.
        stale = _working_lookups(client)
        before = {name: getattr(current, name) for name in fields}
        update = dict(fields)
        if _manages(fields.get("access")) and not current.may_manage:
            update["granted_by"] = _granter(actor)
        for name, value in update.items():
            setattr(client, name, value)
        client.save(update_fields=list(update) or None)
        details = {"before": before, "after": fields}
        if "granted_by" in update:
            details["management_granted_by"] = actor.written
        # A key keeps nothing it was not minted for: one minted without the production approval, or
        # by a member while the client had inference access only, must not gain what the client gains.
        reasons = []
        if fields.get("environment") == ServiceClient.Environment.PRODUCTION \
                and current.environment != ServiceClient.Environment.PRODUCTION:
            reasons.append("moved to production: minted without its approval")
        if "granted_by" in update:
            reasons.append("given management access: minted while it had none")
        if reasons:
            details["revoked"] = _revoke_all(actor, client, "; ".join(reasons))
        audit.record(actor, "client.update", client, details=details)
        events.credentials_changed(stale)
    access.forget_roles(client)
    return client


def _revoke_all(actor: Actor, client: ServiceClient, reason: str) -> list[str]:
    """Revoke every key ``client`` holds now, one audit event each; returns their prefixes. Call
    inside a transaction holding the client's lock; the caller tells the gateways (one message)."""
    now = timezone.now()
    credentials = list(Credential.objects.select_for_update().filter(client=client, revoked_at__isnull=True)
                       .order_by("pk"))
    Credential.objects.filter(pk__in=[c.pk for c in credentials]).update(revoked_at=now)
    for credential in credentials:
        credential.revoked_at = now
        credential.client = client
        audit.record(actor, "credential.revoke", credential, details={"prefix": credential.prefix, "reason": reason})
    return [credential.prefix for credential in credentials]


def delete_client(actor: Actor, client: ServiceClient) -> None:
    """Remove a client and, with it, every key it holds (they stop working at once)."""
    access.require(actor, "use", client)
    with transaction.atomic():
        audit.record(actor, "client.delete", client, details={"name": client.name,
                                                              "credentials": client.credentials.count()})
        events.credentials_changed(_working_lookups(client))  # read before the keys are gone with it
        client.delete()


def _working_lookups(client: ServiceClient) -> list[str]:
    """The lookups of the client's keys a gateway may hold as working (not revoked)."""
    return list(client.credentials.filter(revoked_at__isnull=True).values_list("lookup", flat=True))


def production_evidence(client: ServiceClient) -> dict:
    """What an approval for a production key of ``client`` rests on: change any of it and the
    approval goes stale."""
    return {"client": str(client.public_id), "project": client.project.path, "environment": client.environment,
            "access": client.access, "all_models": client.all_models, "allowed_models": sorted(client.allowed_models),
            "active": client.is_active}


KEY_LIMITS = ("rpm_limit", "tpm_limit", "concurrency_limit")


def create_credential(actor: Actor, client: ServiceClient, *, name: str = "", lifetime: timedelta | None = None,
                      approval=None, **limits) -> tuple[Credential, str]:
    """A new key for ``client``; returns (credential, plaintext). The plaintext exists only here.
    ``limits``: the key's own rpm_limit, tpm_limit, concurrency_limit (each optional)."""
    access.require(actor, "use", client)
    with transaction.atomic():
        # The client as it is now, locked: a concurrent move into production (which revokes every key)
        # or grant of management access is either seen here or waits for this key to exist.
        current = ServiceClient.objects.select_for_update().select_related("project").get(pk=client.pk)
        access.require(actor, key_action(current), current)
        _validate_limits(limits)
        if lifetime is not None and lifetime <= timedelta(0):
            raise InvalidTree("A key's lifetime must be positive (or unset for no expiry).",
                              details={"lifetime": "positive"})
        if current.environment == ServiceClient.Environment.PRODUCTION:
            approvals.consume(actor, "credential.create_production", current.project, current,
                              production_evidence(current), approval)
        credential, plaintext = _mint(actor, current, name=name, lifetime=lifetime, limits=limits)
        audit.record(actor, "credential.create", credential,
                     details={"client": str(current), "prefix": credential.prefix, "expires_at": credential.expires_at,
                              **{k: v for k, v in limits.items() if v is not None}})
    return credential, plaintext


def _validate_limits(limits: dict) -> None:
    problems = {name: "unknown limit" for name in limits if name not in KEY_LIMITS}
    for name in KEY_LIMITS:
        value = limits.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems[name] = "a whole number of at least 1, or null for no limit of the key's own"
    if problems:
        raise InvalidTree("The key's limits are invalid.", details=problems)


def _mint(actor: Actor, client: ServiceClient, *, name: str, lifetime: timedelta | None,
          replaces: Credential | None = None, limits: dict | None = None) -> tuple[Credential, str]:
    plaintext, lookup, secret = keys.new_key()
    now = timezone.now()
    credential = Credential.objects.create(
        client=client, name=(name or "").strip()[:100], lookup=lookup, secret_hash=keys.digest(secret),
        created_by=actor.user, lifetime=lifetime, expires_at=now + lifetime if lifetime else None, replaces=replaces,
        **(limits or {}))
    return credential, plaintext


def revoke_credential(actor: Actor, credential: Credential) -> Credential:
    access.require(actor, "use", credential)
    with transaction.atomic():
        updated = Credential.objects.filter(pk=credential.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        credential.refresh_from_db()
        if updated:
            audit.record(actor, "credential.revoke", credential, details={"prefix": credential.prefix})
            events.credential_revoked(credential.lookup)
    return credential


def rotate_credential(actor: Actor, credential: Credential, overlap: timedelta = timedelta(hours=24)
                      ) -> tuple[Credential, str]:
    """A new key for the same client, keeping the old one's expiry policy; the old one keeps working
    for ``overlap`` (so callers can switch without an outage), then expires."""
    access.require(actor, "use", credential)
    with transaction.atomic():
        # The client first, as update_client locks it: a key of a client moved into production
        # meanwhile is revoked, and is not rotated into a working one.
        client = ServiceClient.objects.select_for_update().select_related("project").get(pk=credential.client_id)
        access.require(actor, key_action(client), client)  # the new plaintext is a key like any other
        if overlap < timedelta(0) or overlap > MAX_OVERLAP:
            raise InvalidTree(f"The overlap must be between 0 and {MAX_OVERLAP.days} days.",
                              details={"overlap": "0-30 days"})
        old = Credential.objects.select_for_update().get(pk=credential.pk)
        old.client = client
        now = timezone.now()
        if old.revoked_at is not None or (old.expires_at is not None and old.expires_at <= now):
            raise InvalidTree("Only a working key can be rotated; create a new one instead.")
        if hasattr(old, "replaced_by"):
            raise AlreadyExists("This key was already rotated.")
        new, plaintext = _mint(actor, old.client, name=old.name, lifetime=old.lifetime, replaces=old,
                               limits={name: getattr(old, name) for name in KEY_LIMITS})
        old.expires_at = min(filter(None, [old.expires_at, now + overlap]))
        old.save(update_fields=["expires_at"])
        events.credentials_changed([old.lookup])  # a gateway would trust it until the expiry it read
        audit.record(actor, "credential.rotate", new, details={"old": old.prefix, "new": new.prefix,
                                                               "old_expires_at": old.expires_at})
    return new, plaintext


def credential_from_header(value: str | None) -> str:
    """The key in an ``Authorization: Bearer brk_…`` header value."""
    if not value:
        raise MalformedAuthorization("Send the key as `Authorization: Bearer brk_…`.")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise MalformedAuthorization("Send the key as `Authorization: Bearer brk_…`.")
    return token.strip()


def authenticate(plaintext: str) -> Credential:
    """The credential a key belongs to, with its client and project: one indexed lookup, one
    constant-time compare. Raises when the key is malformed, unknown, wrong, expired, revoked, or
    its client disabled."""
    parsed = keys.parse(plaintext)
    if parsed is None:
        raise InvalidApiKey("That is not a Berth API key (brk_…).")
    lookup, secret = parsed
    credential = _by_lookup(lookup)
    if credential is None:
        keys.digest(secret)  # the same work as a wrong secret: no timing hint that the lookup missed
        raise InvalidApiKey("Invalid API key.")
    if not keys.matches(secret, credential.secret_hash):
        raise InvalidApiKey("Invalid API key.")
    now = timezone.now()
    usable(credential, now)
    touch(credential, now)
    return credential


def usable(credential: Credential, now=None) -> Credential:
    """``credential`` if it may still be used (not revoked, not expired, its client enabled), else the
    refusal: what a key's every use checks, and what work done later on a key's behalf (a batch's
    requests) checks again each time."""
    now = now or timezone.now()
    if credential.revoked_at is not None:
        raise ApiKeyRevoked("This API key was revoked.")
    if credential.expires_at is not None and credential.expires_at <= now:
        raise ApiKeyExpired("This API key has expired.")
    if not credential.client.is_active:
        raise ClientDisabled("The service client of this key is disabled.")
    return credential


_LOOKUP_SQL: tuple[str, list, list, list] | None = None


def _by_lookup(lookup: str) -> Credential | None:
    """The credential with its client and project, by the unique ``lookup`` index: one query whose SQL
    is built once per process. (The ORM would compile the same three-table join on every call,
    which cost more than the query itself on this hot path.)"""
    global _LOOKUP_SQL
    if _LOOKUP_SQL is None:
        quote = connection.ops.quote_name
        parts, fields = [], []
        for alias, model in (("c", Credential), ("sc", ServiceClient), ("s", Scope)):
            parts += [f"{alias}.{quote(f.column)}" for f in model._meta.concrete_fields]
            fields.append(list(model._meta.concrete_fields))
        sql = (f"SELECT {', '.join(parts)} FROM {quote(Credential._meta.db_table)} c "
               f"JOIN {quote(ServiceClient._meta.db_table)} sc ON sc.{quote('id')} = c.{quote('client_id')} "
               f"JOIN {quote(Scope._meta.db_table)} s ON s.{quote('id')} = sc.{quote('project_id')} "
               f"WHERE c.{quote('lookup')} = %s")
        _LOOKUP_SQL = (sql, *fields)
    sql, credential_fields, client_fields, scope_fields = _LOOKUP_SQL
    with connection.cursor() as cursor:
        cursor.execute(sql, [lookup])
        row = cursor.fetchone()
    if row is None:
        return None
    first, second = len(credential_fields), len(credential_fields) + len(client_fields)
    credential = _instance(Credential, credential_fields, row[:first])
    client = _instance(ServiceClient, client_fields, row[first:second])
    client.project = _instance(Scope, scope_fields, row[second:])
    credential.client = client
    return credential


_CONVERTERS: dict = {}


def _instance(model, fields, values):
    """A model instance from raw column values, converted exactly as the ORM's compiler would: the
    backend's converters first (SQLite hands datetimes back as text, made aware here as the ORM
    does), then the field's own (JSON text to objects…). The converters are gathered once a model."""
    converters = _CONVERTERS.get(model)
    if converters is None:
        converters = []
        for field in fields:
            column = field.get_col(model._meta.db_table)
            converters.append((column, connection.ops.get_db_converters(column) + column.get_db_converters(connection)))
        _CONVERTERS[model] = converters
    converted = []
    for (column, steps), value in zip(converters, values):
        for step in steps:
            value = step(value, column, connection)
        converted.append(value)
    return model.from_db(connection.alias, [field.attname for field in fields], converted)


def touch(credential: Credential, now=None) -> None:
    """Record use at most once a minute per key: a conditional update, so concurrent requests on
    many processes write once between them."""
    now = now or timezone.now()
    if credential.last_used_at is not None and now - credential.last_used_at < LAST_USED_RESOLUTION:
        return
    (Credential.objects.filter(pk=credential.pk)
     .exclude(last_used_at__gt=now - LAST_USED_RESOLUTION)
     .update(last_used_at=now))
    credential.last_used_at = now
