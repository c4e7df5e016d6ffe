"""Errors as HTTP, in one place: the table from the runtime's typed errors to a status and an
`error_type` (the word a client switches on), the errors only the HTTP layer raises, and the
response: `{"error": ..., "error_type": ...}`, or on OpenAI's routes (/v1/...) OpenAI's
`{"error": {"message", "type", "param", "code"}}`, whose message the openai package (and the
frameworks over it) put into their exceptions (`error_body`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson
from starlette.responses import Response

from bertserve.runtime.errors import (
    BackendError,
    ClientGone,
    DeadlineExceeded,
    InvalidInput,
    NotReady,
    Overloaded,
    RequestError,
    TooLarge,
)

if TYPE_CHECKING:
    from bertserve.service.metrics import Metrics

__all__ = [
    "BackendError",
    "ClientGone",
    "Conflict",
    "DeadlineExceeded",
    "Forbidden",
    "HeadersTooLarge",
    "HttpError",
    "InvalidInput",
    "LoadFailed",
    "MethodNotAllowed",
    "NotFound",
    "NotLoaded",
    "NotReady",
    "Overloaded",
    "RequestError",
    "RequestTimeout",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "answer_of",
    "error_body",
    "error_types",
    "openai_route",
]

# The runtime's errors as HTTP: (status, error_type), looked up along the class's bases.
RUNTIME_ERRORS: dict[type[RequestError], tuple[int, str]] = {
    RequestError: (500, "internal"),
    InvalidInput: (422, "invalid_input"),
    TooLarge: (413, "too_large"),
    Overloaded: (429, "overloaded"),
    NotReady: (503, "unavailable"),
    DeadlineExceeded: (504, "timeout"),
    BackendError: (500, "backend"),
    ClientGone: (499, "client_closed"),  # nginx's: the client closed the connection first
}


class HttpError(RequestError):
    """An error only the HTTP layer raises: its status, error_type and headers are its own
    (`status` may be set on the instance, for Starlette's other errors)."""

    status, error_type = 500, "http"

    def __init__(
        self,
        message: str,
        headers: dict[str, str] | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message, retry_after_s)
        self.headers = headers or {}


class BadRequest(HttpError):
    """HTTP the parser cannot read (two Content-Lengths, a bad chunk size, bytes a request line
    may not hold): the connection ends after it."""

    status, error_type = 400, "bad_request"


class Unauthorized(HttpError):
    status, error_type = 401, "unauthorized"


class Forbidden(HttpError):
    """A valid key that may not do this (an API key on the management API)."""

    status, error_type = 403, "forbidden"


class NotFound(HttpError):
    status, error_type = 404, "not_found"


class LoadFailed(HttpError):
    """A bundle that could not be loaded or warmed (the management API): its reason."""

    status, error_type = 422, "load_failed"


class NotLoaded(NotFound):
    """A repository model that is not loaded (explicit model control): `name` says which."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class Conflict(HttpError):
    """The request cannot be carried out in the service's state (static model control)."""

    status, error_type = 409, "conflict"


class MethodNotAllowed(HttpError):
    status, error_type = 405, "method_not_allowed"


class RequestTimeout(HttpError):
    """The client did not send its request (headers or body) in time."""

    status, error_type = 408, "timeout"


class HeadersTooLarge(HttpError):
    status, error_type = 431, "too_large"


class UnsupportedEncoding(HttpError):
    """A body sent compressed (Content-Encoding): read as it arrives, it would not be JSON."""

    status, error_type = 415, "unsupported_media_type"


class UnsupportedTransferCoding(HttpError):
    """A body framed with a transfer coding besides chunked (gzip, deflate): RFC 9112 says 501."""

    status, error_type = 501, "not_implemented"


class Unavailable(HttpError):
    """The service's own 503s that carry headers (`Connection: close` while draining)."""

    status, error_type = 503, "unavailable"


class Answer(NamedTuple):
    status: int
    error_type: str
    headers: dict[str, str]


def answer_of(error: RequestError) -> Answer:
    """What HTTP answers a typed error with."""
    if isinstance(error, HttpError):
        answer = Answer(error.status, error.error_type, dict(error.headers))
    else:
        status, error_type = next(
            RUNTIME_ERRORS[c] for c in type(error).__mro__ if c in RUNTIME_ERRORS
        )
        answer = Answer(status, error_type, {})
    if error.retry_after_s is not None:
        answer.headers["Retry-After"] = str(error.retry_after_s)
    return answer


def error_types() -> tuple[str, ...]:
    """Every error_type the service can answer with: derived from the table and the classes."""
    seen = [kind for _, kind in RUNTIME_ERRORS.values()]
    pending: list[type[HttpError]] = [HttpError]
    while pending:
        cls = pending.pop(0)
        seen.append(cls.error_type)
        pending.extend(cls.__subclasses__())
    return tuple(dict.fromkeys(seen))


PATTERN_MESSAGES = {r"\S": "is empty or blank"}
# OpenAI's `type` by status; `code` is the service's own error_type.
OPENAI_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


def openai_route(path: str) -> bool:
    """Whether `path` is one of OpenAI's routes (/v1/...), whose errors take OpenAI's shape."""
    return path.startswith("/v1/")


def error_body(message: str, error_type: str, status: int, path: str = "") -> bytes:
    """An error's JSON body, in the shape the route's clients read (see the module's doc)."""
    if openai_route(path):
        kind = OPENAI_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        detail = {"message": message, "type": kind, "param": None, "code": error_type}
        return orjson.dumps({"error": detail})
    if path.startswith("/v2/"):  # Cohere's routes: its clients read `message`
        return orjson.dumps({"error": message, "error_type": error_type, "message": message})
    return orjson.dumps({"error": message, "error_type": error_type})


def error_response(
    status: int,
    error_type: str,
    message: str,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> Response:
    """An error's response, for a request to `path` (which decides the body's shape)."""
    body = error_body(message, error_type, status, path)
    return Response(body, status, headers=headers, media_type="application/json")


def service_error_response(exc: RequestError, metrics: Metrics, path: str = "") -> Response:
    """A typed error's response to a request to `path`, counted by its type: what every layer
    that answers for the app (FastAPI's handlers, the fast path, load shedding) sends."""
    answer = answer_of(exc)
    metrics.errors.labels(answer.error_type).inc()
    return error_response(answer.status, answer.error_type, exc.message, answer.headers, path)


def validation_error_response(errors: Any, metrics: Metrics, path: str = "") -> Response:
    return service_error_response(InvalidInput(describe_validation(errors)), metrics, path)


def internal_error_response(metrics: Metrics, path: str = "") -> Response:
    """A bug: logged with its traceback (call from an `except` block), answered as a 500."""
    logging.getLogger("bertserve").exception("unhandled error")
    return service_error_response(
        RequestError("internal error (logged with the request id)"), metrics, path
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
