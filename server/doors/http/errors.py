"""Domain errors -> HTTP statuses: the one table, and the two error bodies (KServe's and OpenAI's).

Statuses follow Triton's HTTP server (HttpCodeFromError): invalid argument 400, not found 404,
unavailable 503, unsupported 501, internal 500. A full queue is UNAVAILABLE in Triton, so 503 here too.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from server import errors
from server.names import capped
from server.doors.http.body import BodyTooLargeError

log = logging.getLogger(__name__)

STATUS = {
    BodyTooLargeError: 413,
    errors.InvalidInputError: 400,
    errors.ConfigError: 400,
    errors.ModelNotFoundError: 404,
    errors.ModelUnavailableError: 503,
    errors.QueueFullError: 503,
    # Triton reports its own queue timeout as UNAVAILABLE (503), which retry policies retry; a request
    # whose deadline has passed gains nothing from a retry, so it gets the gateway-timeout status
    # that the gRPC-HTTP mapping gives DEADLINE_EXCEEDED.
    errors.DeadlineExceededError: 504,
    errors.UnsupportedError: 501,
    errors.BackendError: 500,
    errors.RegionNotFoundError: 404,
    errors.AlreadyExistsError: 409,
    errors.DisabledError: 403,
    errors.UnknownError: 400,  # Triton's HTTP status for UNKNOWN and CANCELLED
    errors.RequestCancelledError: 400,
    errors.ResourceExhaustedError: 429,  # RESOURCE_EXHAUSTED's status in the gRPC-HTTP mapping
}
# OpenAI's `error.type` for each status, as its SDK raises them (BadRequestError, NotFoundError, ...).
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 501: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


def status_of(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def message_of(exc: BaseException) -> str:
    """The client-facing text; anything that is not a FerryError is a Ferry bug, logged once here."""
    if isinstance(exc, errors.FerryError):
        return capped(exc.message)
    log.error("unexpected error in an HTTP handler", exc_info=exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def kserve_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def openai_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _OPENAI_TYPE.get(status, "server_error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status)


def openai_body(exc: BaseException) -> dict:
    """OpenAI's error object for an error met mid-stream (the status line is already sent)."""
    status = status_of(exc)
    return {"error": {"message": message_of(exc), "type": _OPENAI_TYPE.get(status, "server_error"), "param": None,
                      "code": status}}
