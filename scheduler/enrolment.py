"""Node trust: one-time enrolment tokens, and each node's own credential.

An operator issues an enrolment token (``bne_<lookup>_<secret>``, shown once, expiring); the agent on
the new machine exchanges it (``enrol``) for its node's credential (``bnc_<lookup>_<secret>``), which it
keeps (mode 0600) and sends as ``Authorization: Bearer`` to the node API. The token is then spent. Of
both only the lookup and HMAC-SHA256(key pepper, secret) are stored, as for API keys
(``tenancy.keys``): a copy of the database alone can neither use nor mint them.

A node from before enrolment (no credential) is given one by a token issued for it
(``issue_token(existing=node)``, ``manage.py nodes enrol --existing NAME``) or by ``issue_credential``
(``manage.py nodes credential NAME``). ``revoke`` refuses the credential from the next request on; the
node row stays, shown revoked, until it is enrolled again with a token issued for it.

Issuing, withdrawing and revoking are the fleet operators' (staff, or Berth itself on the server);
every change is audited in the same transaction.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from scheduler import reach
from scheduler.errors import (
    EnrolmentTokenExpired,
    EnrolmentTokenInvalid,
    EnrolmentTokenSpent,
    EnrolmentTokenUsed,
    InvalidEnrolmentRequest,
    InvalidNodeReport,
    NodeNameTaken,
    NodeNotFound,
    NodeTrustForStaff,
)
from scheduler.models import EnrolmentToken, Node
from tenancy import audit, keys

TOKEN_PREFIX = "bne_"
CREDENTIAL_PREFIX = "bnc_"
_SECRET = r"([0-9a-f]{12})_([A-Za-z0-9_-]{43,128})"
_TOKEN = re.compile(rf"^{TOKEN_PREFIX}{_SECRET}$")
_CREDENTIAL = re.compile(rf"^{CREDENTIAL_PREFIX}{_SECRET}$")
# A node's name is also its queue's and its files' (``node.<name>``): a host name's letters, no spaces.
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
_ADDRESS = re.compile(r"^[A-Za-z0-9.:\[\]_%-]{1,255}$")  # a host name, an IPv4 or IPv6 address
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 60, 7 * 86400


@dataclasses.dataclass(frozen=True)
class NodeActor(audit.Actor):
    """A node acting through its credential (or enrolling with a token), as the audit log names it:
    ``node:<name>``. Neither a person nor a client nor Berth itself: no access check lets it through."""

    node: str = ""

    @property
    def written(self) -> str:
        return f"node:{self.node}"[:200]


def _new(prefix: str) -> tuple[str, str, str]:
    """A fresh secret: (plaintext, lookup, secret); 32 random bytes, as API keys."""
    lookup = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return f"{prefix}{lookup}_{secret}", lookup, secret


def _parse(pattern: re.Pattern, plaintext: str) -> tuple[str, str] | None:
    match = pattern.match((plaintext or "").strip())
    return (match.group(1), match.group(2)) if match else None


def _require_operator(actor: audit.Actor) -> None:
    if actor.user is None and actor.client is None and actor.system:
        return  # Berth itself: manage.py on the control plane
    if actor.user is not None and reach.sees_everything(actor.user):
        return
    raise NodeTrustForStaff("Enrolling, credentials and revoking nodes are for the fleet's operators (staff).")


def name_problem(name: str) -> str | None:
    if not _NAME.match(name or ""):
        return ("A node's name is 1 to 253 letters, digits, dots, dashes or underscores, "
                "beginning and ending with a letter or digit.")
    return None


def _address_problem(address: str) -> str | None:
    if not _ADDRESS.match(address or ""):
        return "A node needs an address where its engines are reached: a host name or an IP address."
    return None


def enrolled(node: Node) -> bool:
    """Whether the node was given a credential (live or revoked): only a token issued for it may give
    it another. A node from before enrolment holds none."""
    return node.credential_lookup is not None or node.revoked_at is not None


def node_named(name: str) -> Node:
    node = Node.objects.filter(name=name).first()
    if node is None:
        raise NodeNotFound(f"No node is named {name!r}.", details={"name": name})
    return node


def _taken(name: str) -> NodeNameTaken:
    return NodeNameTaken(f"A node named {name} is enrolled already. To give it a new credential, issue a token "
                         f"for it (manage.py nodes enrol --existing {name}).", details={"name": name})


# --- enrolment tokens ------------------------------------------------------------------------------

def issue_token(actor: audit.Actor, *, name: str = "", existing: Node | str | None = None,
                ttl_seconds: int = 3600) -> tuple[EnrolmentToken, str]:
    """A one-time token that enrols a node: ``name`` (blank: the agent says its own), or the registered
    node ``existing`` (its credential is issued anew). Returns the row and the plaintext, which is
    not kept anywhere: show it once."""
    _require_operator(actor)
    if not isinstance(ttl_seconds, int) or not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidEnrolmentRequest(
            f"An enrolment token lasts {MIN_TTL_SECONDS // 60} minute to {MAX_TTL_SECONDS // 86400} days.",
            details={"ttl_seconds": ttl_seconds})
    name = (name or "").strip()
    node = None
    if existing is not None:
        node = existing if isinstance(existing, Node) else node_named(str(existing).strip())
        if name and name != node.name:
            raise InvalidEnrolmentRequest("A token for an existing node takes that node's name.",
                                          details={"name": name, "existing": node.name})
        name = node.name
    elif name:
        problem = name_problem(name)
        if problem:
            raise InvalidEnrolmentRequest(problem, details={"name": name})
        known = Node.objects.filter(name=name).first()
        if known is not None and enrolled(known):
            raise _taken(name)
    plaintext, lookup, secret = _new(TOKEN_PREFIX)
    with transaction.atomic():
        token = EnrolmentToken.objects.create(
            lookup=lookup, digest=keys.digest(secret), name=name, node=node, created_by=actor.written[:255],
            expires_at=timezone.now() + timedelta(seconds=ttl_seconds))
        audit.record(actor, "node.enrolment_token.issue", token, details={
            "token": str(token.public_id), "name": name, "existing": node is not None,
            "expires_at": token.expires_at.isoformat()})
    return token, plaintext


def withdraw_token(actor: audit.Actor, token: EnrolmentToken) -> None:
    """Delete a token that was not used (an expired one too); a used one stays as the record of the
    enrolment (revoke the node instead)."""
    _require_operator(actor)
    with transaction.atomic():
        token = EnrolmentToken.objects.select_for_update().get(pk=token.pk)
        if token.used_at is not None:
            raise EnrolmentTokenUsed("This token was used already: revoke the node it enrolled instead.",
                                     details={"token": str(token.public_id)})
        audit.record(actor, "node.enrolment_token.withdraw", token, details={"token": str(token.public_id),
                                                                            "name": token.name})
        token.delete()


def enrol(token: str, *, name: str, address: str, remote_address: str | None = None) -> tuple[Node, str]:
    """Spend ``token`` (once, under its row's lock) for a node's credential: (node, plaintext).

    The node is the one the token was issued for, else the token's name, else the agent's ``name``;
    it is created when new, with ``address``. A name whose node was enrolled already is refused
    unless the token was issued for that node (409 ``node_name_taken``)."""
    parsed = _parse(_TOKEN, token)
    if parsed is None:
        raise EnrolmentTokenInvalid("That is not a Berth enrolment token (bne_…).")
    lookup, secret = parsed
    name, address = (name or "").strip(), (address or "").strip()
    with transaction.atomic():
        row = EnrolmentToken.objects.select_for_update().filter(lookup=lookup).first()
        if row is None:
            keys.digest(secret)  # the same work as a wrong secret: no timing hint that the lookup missed
            raise EnrolmentTokenInvalid("Invalid enrolment token.")
        if not keys.matches(secret, row.digest):
            raise EnrolmentTokenInvalid("Invalid enrolment token.")
        if row.used_at is not None:
            raise EnrolmentTokenSpent("This enrolment token was used already: ask for a new one.")
        now = timezone.now()
        if row.expires_at <= now:
            raise EnrolmentTokenExpired("This enrolment token has expired: ask for a new one.",
                                        details={"expired_at": row.expires_at.isoformat()})
        node, created = _enrolling(row, name, address)
        plaintext = _issue(node, now)
        row.used_at, row.used_by_node = now, node
        row.save(update_fields=["used_at", "used_by_node"])
        audit.record(NodeActor(node=node.name, address=remote_address), "node.enrol", node, details={
            "token": str(row.public_id), "created": created, "existing": row.node_id is not None,
            "address": node.address, "lookup": node.credential_lookup})
    return node, plaintext


def _enrolling(row: EnrolmentToken, name: str, address: str) -> tuple[Node, bool]:
    """The node a token enrols, locked (created when new): (node, created)."""
    if address and _address_problem(address):
        raise InvalidNodeReport("The node report is invalid.", details={"address": _address_problem(address)})
    if row.node_id is not None:
        node = Node.objects.select_for_update().get(pk=row.node_id)
        if address and address != node.address:
            node.address = address
            node.save(update_fields=["address", "updated_at"])
        return node, False
    name = row.name or name
    problems = {key: problem for key, problem in (("name", name_problem(name)),
                                                    ("address", _address_problem(address))) if problem}
    if problems:
        raise InvalidNodeReport("The node report is invalid.", details=problems)
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is not None:
        if enrolled(node):
            raise _taken(name)
        node.address = address  # a node from before enrolment: taken over by the token naming it
        node.save(update_fields=["address", "updated_at"])
        return node, False
    try:
        with transaction.atomic():  # a savepoint: another enrolment may create the same name meanwhile
            return Node.objects.create(name=name, address=address), True
    except IntegrityError:
        raise _taken(name) from None


# --- the node's credential -------------------------------------------------------------------------

def _issue(node: Node, now) -> str:
    """A new credential for ``node`` (locked by the caller), replacing any it had; un-revokes it."""
    plaintext, lookup, secret = _new(CREDENTIAL_PREFIX)
    node.credential_lookup, node.credential_digest = lookup, keys.digest(secret)
    node.credential_issued_at, node.revoked_at = now, None
    node.save(update_fields=["credential_lookup", "credential_digest", "credential_issued_at", "revoked_at",
                             "updated_at"])
    return plaintext


def issue_credential(actor: audit.Actor, node: Node | str, *, address: str = "") -> str:
    """A new credential for ``node`` (a row or a name), replacing (rotating) the one it had and lifting a
    revocation: what ``make up`` gives the control-plane machine's own agent, and ``nodes credential``.
    A name of no node is registered with ``address`` when one is given. Returns the plaintext, not kept."""
    _require_operator(actor)
    with transaction.atomic():
        if isinstance(node, Node):
            node = Node.objects.select_for_update().get(pk=node.pk)
        else:
            name = str(node).strip()
            found = Node.objects.select_for_update().filter(name=name).first()
            if found is None and not address:
                raise NodeNotFound(f"No node is named {name!r}: give its address to register it.",
                                   details={"name": name})
            if found is None:
                problems = {key: problem for key, problem in (("name", name_problem(name)),
                                                                ("address", _address_problem(address))) if problem}
                if problems:
                    raise InvalidNodeReport("The node report is invalid.", details=problems)
                found = Node.objects.create(name=name, address=address)
            node = found
        replaced, was_revoked = node.credential_lookup, node.revoked_at is not None
        plaintext = _issue(node, timezone.now())
        audit.record(actor, "node.credential.issue", node, details={
            "lookup": node.credential_lookup, "replaced": replaced, "was_revoked": was_revoked})
    return plaintext


def revoke(actor: audit.Actor, node: Node) -> Node:
    """Refuse the node's credential from now on (every node request reads it: at once). The node row
    stays, shown revoked; a token issued for it (``--existing``) enrols it again. Twice is harmless."""
    _require_operator(actor)
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        if node.revoked_at is None:
            node.revoked_at = timezone.now()
            node.save(update_fields=["revoked_at", "updated_at"])
            audit.record(actor, "node.revoke", node, details={"lookup": node.credential_lookup})
    return node


def identify(credential: str) -> Node | None:
    """The node a credential was issued to, revoked or not (the node API tells the two apart);
    None when it is malformed, unknown or wrong. One indexed lookup, one constant-time compare."""
    parsed = _parse(_CREDENTIAL, credential)
    if parsed is None:
        return None
    lookup, secret = parsed
    node = Node.objects.filter(credential_lookup=lookup).first()
    if node is None or node.credential_digest is None:
        keys.digest(secret)  # the same work as a wrong secret
        return None
    return node if keys.matches(secret, node.credential_digest) else None


def authenticate(credential: str) -> Node | None:
    """The node whose live credential this is, else None (malformed, unknown, wrong or revoked)."""
    node = identify(credential)
    return node if node is not None and node.revoked_at is None else None
