"""Error codes of the tenancy app. Clients branch on ``code``; never reword one."""

from berth.errors import BerthError, Conflict, InvalidInput, NotAuthenticated, NotFound, PermissionDenied


class ScopeSyntax(InvalidInput):
    code = "invalid_scope"


class UnknownScopeKind(InvalidInput):
    code = "unknown_scope_kind"


class AmbiguousScope(InvalidInput):
    code = "ambiguous_scope"


class ScopeNotFound(NotFound):
    code = "scope_not_found"


class InvalidTree(InvalidInput):
    code = "invalid_tree"


class AlreadyExists(Conflict):
    code = "already_exists"


class InUse(Conflict):
    code = "in_use"


class LastOwner(Conflict):
    code = "last_owner"


class Forbidden(PermissionDenied):
    code = "permission_denied"


class InvalidApiKey(NotAuthenticated):
    code = "invalid_api_key"


class MalformedAuthorization(NotAuthenticated):
    code = "malformed_authorization"


class ApiKeyExpired(NotAuthenticated):
    code = "api_key_expired"


class ApiKeyRevoked(NotAuthenticated):
    code = "api_key_revoked"


class ClientDisabled(PermissionDenied):
    code = "client_disabled"


class InvalidContract(InvalidInput):
    code = "invalid_contract"


class CapacityExceeded(Conflict):
    code = "capacity_exceeded"


class ApprovalRequired(BerthError):
    status = 428
    code = "approval_required"


class ApprovalInvalid(Conflict):
    code = "approval_invalid"


class ApprovalStale(Conflict):
    code = "approval_stale"


class ApprovalExpired(Conflict):
    code = "approval_expired"


class FourEyes(PermissionDenied):
    code = "four_eyes"


class LoginThrottled(BerthError):
    status = 429
    code = "login_throttled"


class Busy(BerthError):
    status = 503
    code = "busy"
