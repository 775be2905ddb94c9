"""The management API's one error format: ``{"error": {"code", "message", "details"}}``.

DRF's own exceptions, Django's 404 and permission errors and our ``BerthError`` all pass through
``exception_handler`` so a client parses exactly one shape, whatever went wrong.
"""

from __future__ import annotations

import logging

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import InterfaceError, OperationalError
from django.http import Http404
from rest_framework import exceptions as drf
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response

from berth.errors import BerthError

log = logging.getLogger(__name__)
DATABASE_RETRY_SECONDS = 5

# DRF's exception classes mapped to our stable codes (DRF's own codes are not a contract of ours).
_DRF_CODES = {
    drf.ValidationError: "invalid",
    drf.ParseError: "malformed_body",
    drf.NotAuthenticated: "not_authenticated",
    drf.AuthenticationFailed: "authentication_failed",
    drf.PermissionDenied: "permission_denied",
    drf.NotFound: "not_found",
    drf.MethodNotAllowed: "method_not_allowed",
    drf.NotAcceptable: "not_acceptable",
    drf.UnsupportedMediaType: "unsupported_media_type",
    drf.Throttled: "rate_limited",
}


def error_body(code: str, message: str, details=None) -> dict:
    return {"error": {"code": code, "message": message, "details": details if details is not None else {}}}


def exception_handler(exc, context):
    if isinstance(exc, BerthError):
        return Response(error_body(exc.code, exc.message, exc.details), status=exc.status)
    if isinstance(exc, (OperationalError, InterfaceError)):
        # The database away (restarting, out of reach) or a transaction it rolled back
        # (a deadlock, a timeout): no bug of the request's, and one to try again, as the gateway says it.
        log.warning("%s %s: the database did not answer (%s)", context["request"].method,
                    context["request"].path, str(exc).strip()[:300])
        return Response(error_body("database_unavailable", "The database did not answer this request (it may be "
                                   "restarting or out of reach); try again in a few seconds."),
                        status=503, headers={"Retry-After": str(DATABASE_RETRY_SECONDS)})
    if isinstance(exc, Http404):
        exc = drf.NotFound("No such object, or it is outside your reach.")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = drf.PermissionDenied()
    if not isinstance(exc, drf.APIException):
        return None  # a bug: let Django's 500 handling (and its logging) take it
    code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), "error")
    if isinstance(exc, drf.ValidationError):
        message, details = "The request has invalid fields; see details.", exc.detail
    else:
        message, details = str(exc.detail), {}
    headers = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None) is not None:
        headers["Retry-After"] = str(int(exc.wait))
    return Response(error_body(code, message, details), status=exc.status_code, headers=headers)


class Pagination(LimitOffsetPagination):
    """Every API list's pages: ``?limit=`` (default ``PAGE_SIZE``) and ``?offset=``. A limit above
    ``max_limit`` is clamped to it, as DRF users expect, rather than reaching the database as a
    number it cannot hold (2**63 was a server error)."""

    max_limit = 1000
