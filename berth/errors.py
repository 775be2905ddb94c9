"""The one error type every layer raises and every transport renders.

A ``BerthError`` carries an HTTP status, a stable machine code (clients branch on it; never reword
one), a message a person can act on and optional details. The API renders it as
``{"error": {"code", "message", "details"}}``; the gateway renders the same object in OpenAI's
shape. Apps declare their codes in their own ``errors.py`` as subclasses or instances of these.
"""

from __future__ import annotations

from typing import Any


class BerthError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 details: Any = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.details = details if details is not None else {}

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidInput(BerthError):
    status = 400
    code = "invalid"


class NotAuthenticated(BerthError):
    status = 401
    code = "not_authenticated"


class PermissionDenied(BerthError):
    status = 403
    code = "permission_denied"


class NotFound(BerthError):
    """Also what a caller gets for an object outside their reach: never confirm it exists."""

    status = 404
    code = "not_found"


class Conflict(BerthError):
    status = 409
    code = "conflict"


class Unavailable(BerthError):
    status = 503
    code = "unavailable"
