"""The runtime's typed errors (runtime/errors.py) mapped to HTTP in one place:
`{"error": ..., "error_type": ...}`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from runtime.errors import (  # noqa: F401  (re-exported: the service's one error module)
    BackendError,
    ClientGone,
    DeadlineExceeded,
    HeadersTooLarge,
    HttpError,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    NotReady,
    Overloaded,
    RequestTimeout,
    ServiceError,
    TooLarge,
    Unauthorized,
    error_types,
)

if TYPE_CHECKING:
    from service.metrics import Metrics

PATTERN_MESSAGES = {r"\S": "is empty or blank"}


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
