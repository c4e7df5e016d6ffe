"""The runtime's typed errors: each carries the HTTP status and error_type the service answers
it with (service/errors.py maps them to responses, in one place), so the task code, the engine
and the batcher raise what a client can act on without knowing HTTP."""

from __future__ import annotations


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
