"""Typed service errors and their one mapping to HTTP: `{"error": ..., "error_type": ...}`."""

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


class DeadlineExceeded(ServiceError):
    status, error_type = 504, "timeout"


class BackendError(ServiceError):
    status, error_type = 500, "backend"
