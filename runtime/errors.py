"""The runtime's typed errors: what a request can meet in the task code, the engine or the
batcher, named for a caller to act on and free of HTTP. Whoever serves them gives each its answer
(the service's table is service/http/errors.py); `retry_after_s` says when trying again may
succeed."""

from __future__ import annotations


class RequestError(Exception):
    """A request's failure that its caller can act on; the base of every error the runtime
    raises on purpose (anything else is a bug)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidInput(RequestError):
    """The input cannot be answered as it is (an empty text, a missing [MASK], a bad id)."""


class TooLarge(RequestError):
    """The input is longer or larger than the model or the limits take."""


class Overloaded(RequestError):
    """Every model that serves the task has a full queue: refused before any work."""


class NotReady(RequestError):
    """The model cannot take work now (starting, stopping or failed)."""


class DeadlineExceeded(RequestError):
    """The request's deadline passed before its answer was ready."""


class BackendError(RequestError):
    """The inference backend failed on a batch (ONNX Runtime raised, or its process died)."""


class ClientGone(RequestError):
    """The caller went away before its answer was ready: the work is dropped."""
