"""Typed service errors and their one mapping to HTTP: `{"error": ..., "error_type": ...}`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from service.metrics import Metrics

PATTERN_MESSAGES = {r"\S": "is empty or blank", r"\[MASK\]": "has no [MASK] token"}


class ServiceError(Exception):
    status = 500
    error_type = "internal"

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class InvalidInput(ServiceError):
    status, error_type = 422, "invalid_input"


class TooLarge(ServiceError):
    status, error_type = 413, "too_large"


class Unauthorized(ServiceError):
    status, error_type = 401, "unauthorized"


class NotFound(ServiceError):
    status, error_type = 404, "not_found"


class Overloaded(ServiceError):
    status, error_type = 429, "overloaded"


class NotReady(ServiceError):
    status, error_type = 503, "unavailable"


class RequestTimeout(ServiceError):
    """The client did not send its request (headers or body) in time."""

    status, error_type = 408, "timeout"


class HeadersTooLarge(ServiceError):
    status, error_type = 431, "too_large"


class DeadlineExceeded(ServiceError):
    status, error_type = 504, "timeout"


class BackendError(ServiceError):
    status, error_type = 500, "backend"


class MethodNotAllowed(ServiceError):
    status, error_type = 405, "method_not_allowed"


class HttpError(ServiceError):
    """Another status the HTTP layer answers with (set on the instance)."""

    error_type = "http"


class ClientGone(ServiceError):
    """The client closed the connection before its answer was ready (nginx's 499)."""

    status, error_type = 499, "client_closed"


def error_types() -> tuple[str, ...]:
    """Every error_type the service can answer with: derived from the classes, not listed."""
    seen: list[str] = []
    pending: list[type[ServiceError]] = [ServiceError]
    while pending:
        cls = pending.pop(0)
        if cls.error_type not in seen:
            seen.append(cls.error_type)
        pending.extend(cls.__subclasses__())
    return tuple(seen)


def error_response(
    status: int, error_type: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status, headers=headers)


def service_error_response(exc: ServiceError, metrics: Metrics) -> JSONResponse:
    """A typed error's response, counted by its type: what every layer that answers for the
    app (FastAPI's handlers, the fast path, load shedding) sends."""
    metrics.errors.labels(exc.error_type).inc()
    return error_response(exc.status, exc.error_type, exc.message, exc.headers)


def validation_error_response(errors: Any, metrics: Metrics) -> JSONResponse:
    return service_error_response(InvalidInput(describe_validation(errors)), metrics)


def internal_error_response(metrics: Metrics) -> JSONResponse:
    """A bug: logged with its traceback (call from an `except` block), answered as a 500."""
    logging.getLogger("service").exception("unhandled error")
    return service_error_response(
        ServiceError("internal error (logged with the request id)"), metrics
    )


def describe_validation(errors: Any) -> str:
    """Pydantic's errors as one line a user can act on. Each union member (a string or a list)
    reports its own failure; type mismatches of the members that were not meant are dropped
    when a more specific error exists."""
    parts: list[str] = []
    errors = list(errors)
    specific = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    for error in (specific or errors)[:3]:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        where = ".".join(p for p in loc if not _union_tag(p)) or "body"
        kind, ctx = error.get("type"), error.get("ctx") or {}
        if kind == "json_invalid":
            message = "the body is not valid JSON (UTF-8)"
        elif kind == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_MESSAGES:
            message = f"{where}: {PATTERN_MESSAGES[ctx['pattern']]}"
        elif kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
            message = f"{where}: is empty"
        else:
            message = f"{where}: {error.get('msg')}"
        if message not in parts:
            parts.append(message)
    return "; ".join(parts)


def _union_tag(part: str) -> bool:
    """Path segments pydantic adds for union members: "NspInput", "list[str]", "constrained-str"."""
    return part[:1].isupper() or "[" in part or part == "str" or part.startswith("constrained-")
