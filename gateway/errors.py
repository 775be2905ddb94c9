"""Error codes of the gateway app. Under /v1/ they are rendered in OpenAI's shape
(``{"error": {"message", "type", "code", "param"}}``); clients branch on ``code``, never reword one."""

from berth.errors import (BerthError, Conflict, InvalidInput, NotAuthenticated, NotFound, PermissionDenied,
                          Unavailable)

SHOWN_NAME = 100  # characters of what a caller sent (a model name, a value) echoed in an error


def shown(name: str) -> str:
    """What the caller sent, as an error echoes it: at most ``SHOWN_NAME`` characters (a name of
    any length is refused, but never sent back whole)."""
    return name if len(name) <= SHOWN_NAME else name[:SHOWN_NAME] + "…"


class BadRequest(InvalidInput):
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.param = param


class AboveCap(BadRequest):
    """``max_tokens`` (or ``max_completion_tokens``, ``n_predict``) above the catalog model's own cap
    (``max_output_tokens``)."""

    code = "max_tokens_above_cap"


class AboveContext(BadRequest):
    """The same above the longest context the model runs with (it has no cap of its own)."""

    code = "max_tokens_above_context"


class RouteNotServed(BadRequest):
    """The API route asked for (``/v1/messages``, ``/v1/responses``…) is not served by the engine the
    model runs on (``gateway.routes``): the engine is named in the message and ``details``."""

    code = "route_not_served"


class MissingKey(NotAuthenticated):
    code = "missing_api_key"


class InferenceNotAllowed(PermissionDenied):
    code = "inference_not_allowed"


class MetricsNotAllowed(PermissionDenied):
    """/metrics names every model and its traffic: only this machine, or the bearer of the metrics token."""

    code = "metrics_not_allowed"


class ModelNotAllowed(PermissionDenied):
    code = "model_not_allowed"


class EnvironmentNotAllowed(PermissionDenied):
    """The model (through a ``ModelSplit``) is restricted to other client environments."""

    code = "environment_not_allowed"


class ModelNotFound(NotFound):
    code = "model_not_found"


class EndpointNotFound(NotFound):
    code = "unknown_endpoint"


class MethodNotAllowed(BerthError):
    status = 405
    code = "method_not_allowed"


class TooLarge(BerthError):
    status = 413
    code = "request_too_large"


class RateLimited(BerthError):
    status = 429
    code = "rate_limit_exceeded"


class ConcurrencyLimited(RateLimited):
    code = "concurrency_limit_exceeded"


class BudgetExceeded(RateLimited):
    code = "budget_exceeded"


class QueueFull(RateLimited):
    code = "queue_full"


class ServerBusy(RateLimited):
    """Every slot of the model's replicas is busy and its wait queue has no room for this priority."""

    code = "server_busy"


class ModelLoading(Unavailable):
    """Retry later: answered with ``Retry-After``."""

    code = "model_loading"


class NoReplica(Unavailable):
    code = "no_ready_replica"


class UpstreamError(BerthError):
    status = 502
    code = "upstream_error"


class UpstreamTimeout(BerthError):
    status = 504
    code = "upstream_timeout"


class LimiterUnavailable(Unavailable):
    """Limits or budgets cannot be checked right now (Redis does not answer within
    ``GATEWAY_REDIS_TIMEOUT``, or a lost budget cannot be rebuilt from the database): refused, never
    served unlimited; retry after ``Retry-After``."""

    code = "limiter_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, **kwargs):
        super().__init__(message, **kwargs)
        self.headers = [(b"retry-after", str(retry_after).encode())]


class DatabaseUnavailable(Unavailable):
    """The database cannot be reached to check a key the gateway has no recent reading of (a key
    never seen, or seen longer ago than ``GATEWAY_AUTH_STALE_SECONDS``): retry later, with ``Retry-After``."""

    code = "database_unavailable"

    def __init__(self, message: str, *, retry_after: int = 5, **kwargs):
        super().__init__(message, **kwargs)
        self.headers = [(b"retry-after", str(retry_after).encode())]


# The Batch API (``gateway.batch``).

class InvalidBatchFile(BadRequest):
    """A batch input that is not what ``/v1/batches`` can run; ``details`` name the line and why."""

    code = "invalid_batch_file"


class FileNotFound(NotFound):
    """Also another client's file: never confirmed to exist."""

    code = "file_not_found"


class FileInUse(Conflict):
    code = "file_in_use"


class BatchNotFound(NotFound):
    code = "batch_not_found"


class BatchEnded(Conflict):
    """Cancelling a batch that has already ended."""

    code = "batch_ended"


class BatchSignatureInvalid(NotAuthenticated):
    code = "invalid_batch_signature"


class BatchLineTaken(Conflict):
    """A batch's line already sent (or being sent): never sent twice."""

    code = "batch_line_taken"


# OpenAI's ``type`` for each status, so clients that switch on it behave as with OpenAI.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
               502: "api_error", 503: "service_unavailable", 504: "timeout"}

# Anthropic's ``error.type`` for each status, for the Messages routes (``{"type": "error", "error":
# {"type", "message"}}``), so Anthropic's clients raise the error class they would against Anthropic.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                         413: "request_too_large",
                         422: "invalid_request_error", 429: "rate_limit_error", 499: "api_error",
                         502: "api_error", 503: "overloaded_error", 504: "timeout_error"}
