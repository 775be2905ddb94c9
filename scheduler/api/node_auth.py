"""The node API's authentication: ``Authorization: Bearer bnc_…``, a node's own credential.

Only the node API's views name ``NodeAuthentication`` (with ``IsNode``); no other API takes it, and
``tenancy``'s management keys and the gateway refuse a ``bnc_`` bearer as no key of theirs. A request
without a ``bnc_`` bearer is not this class's (None), so it never collides with sessions or API keys.

What a node may touch is its own: ``refuse_foreign`` is the one answer, audited, to a node reading or
reporting another node's job or replica.
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, permissions

from scheduler import enrolment
from scheduler.enrolment import CREDENTIAL_PREFIX, NodeActor
from scheduler.errors import NodeCredentialInvalid, NodeOwnershipMismatch, NodeRevoked
from scheduler.models import Node
from tenancy import audit


class NodePrincipal:
    """``request.user`` of a node's request: the node, and nobody's member. Not staff, no superuser, no
    memberships: every management check refuses it (it should never reach one: only node views
    authenticate nodes)."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    def __init__(self, node: Node, address: str | None = None):
        self.node = node
        self.address = address

    @property
    def actor(self) -> NodeActor:
        """Who the audit log says acted (``node:<name>``); ``audit.Actor.from_request`` does not know nodes."""
        return NodeActor(node=self.node.name, address=self.address)

    def get_username(self) -> str:
        return f"node:{self.node.name}"

    def __str__(self) -> str:
        return self.get_username()


def _bearer(request) -> str | None:
    scheme, _, token = (request.META.get("HTTP_AUTHORIZATION") or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token.startswith(CREDENTIAL_PREFIX) else None


class NodeAuthentication(authentication.BaseAuthentication):
    """``(NodePrincipal(node), node)`` for a node's live credential; 401 ``node_credential_invalid`` for
    a ``bnc_`` bearer that is no node's, 401 ``node_revoked`` for a revoked node's."""

    keyword = "Bearer"

    def authenticate(self, request):
        credential = _bearer(request)
        if credential is None:
            return None
        node = enrolment.identify(credential)
        if node is None:
            raise NodeCredentialInvalid("Invalid node credential.")
        if node.revoked_at is not None:
            raise NodeRevoked(f"Node {node.name}'s credential was revoked: enrol it again with a token issued "
                              f"for it.", details={"node": node.name})
        return NodePrincipal(node, request.META.get("REMOTE_ADDR") or None), node

    def authenticate_header(self, request):
        return f'{self.keyword} realm="node"'  # makes a missing credential a 401, not a 403


class NodeAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = NodeAuthentication
    name = "nodeCredential"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "bnc_<lookup>_<secret>",
                "description": "A node's own credential, from enrolment (POST /api/node/enrol/)."}


class IsNode(permissions.BasePermission):
    message = "The node API takes a node's credential (Authorization: Bearer bnc_…)."

    def has_permission(self, request, view):
        return isinstance(request.auth, Node) and isinstance(request.user, NodePrincipal)


def refuse_foreign(node: Node, what: str, obj) -> None:
    """Refuse ``node``'s attempt (``what``, e.g. "complete job") on ``obj``, which is another node's:
    audited as ``node.ownership_mismatch``, then 403 ``node_ownership_mismatch``.

    The event is written on the caller's connection: call this outside any transaction the refusal
    rolls back (find the object, compare its node, then lock), or the evidence goes with it."""
    object_id = str(getattr(obj, "public_id", None) or getattr(obj, "pk", None) or "")
    audit.record(NodeActor(node=node.name), "node.ownership_mismatch", obj, details={
        "node": node.name, "node_id": str(node.public_id), "what": what, "object": object_id})
    raise NodeOwnershipMismatch(f"Node {node.name} may not {what}: that belongs to another node.",
                                details={"what": what, "object": object_id})
