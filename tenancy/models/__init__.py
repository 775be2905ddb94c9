"""Tenancy's tables, one module per sub-domain."""

from tenancy.models.approvals import ApprovalRequest
from tenancy.models.audit import AuditEvent
from tenancy.models.clients import Credential, ServiceClient
from tenancy.models.contracts import Contract, Reservation
from tenancy.models.tree import ROLE_RANK, Membership, Role, Scope

__all__ = ["ROLE_RANK", "ApprovalRequest", "AuditEvent", "Contract", "Credential", "Membership", "Reservation", "Role",
           "Scope", "ServiceClient"]
