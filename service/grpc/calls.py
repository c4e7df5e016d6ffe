"""What every gRPC call shares (service.grpc.oip, service.grpc.tei): its admission as an HTTP
request to its JSON route is admitted, its API key, its trace, and its refusal with the gRPC
status code of its HTTP status."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import ValidationError

from bertserve.service.http.asgi import Urgency, parse_urgency
from bertserve.service.http.auth import check_key
from bertserve.service.http.errors import (
    InvalidInput,
    RequestError,
    answer_of,
    describe_validation,
)
from bertserve.service.state import ServiceState, Slot
from bertserve.service.tracing import edge_spans

log = logging.getLogger("bertserve")

# Set in the task that answers one message of a stream (service.grpc.tei.Base.stream): it is
# admitted and queued as a client batch's row (the bulk lane), so a stream of many messages
# waits for the model instead of meeting 429s; and its refusal is raised as `Refused` for the
# stream's handler to end the call with. grpc.aio's `context.abort` is the handler's own to
# call: called from another task while the handler writes an earlier answer, the status never
# reaches the client, which then waits forever.
STREAMED: contextvars.ContextVar[bool] = contextvars.ContextVar("streamed", default=False)


class Refused(Exception):
    """A stream's message refused with `error` (its status and message already counted in
    bertserve_requests_total); the stream's handler aborts the call with it."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


# HTTP status -> gRPC status code, as text-embeddings-inference maps its errors (validation:
# INVALID_ARGUMENT, overload: RESOURCE_EXHAUSTED, unhealthy: UNAVAILABLE).
STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def urgency(context: grpc.aio.ServicerContext) -> Urgency:
    """A call's priority and timeout: the metadata `x-request-priority` and
    `x-request-timeout-ms` (as HTTP's headers), the timeout capped by the call's own gRPC
    deadline."""
    metadata = dict(context.invocation_metadata() or ())
    priority, timeout = metadata.get("x-request-priority"), metadata.get("x-request-timeout-ms")
    asked = parse_urgency(
        priority if isinstance(priority, str) else None,
        timeout if isinstance(timeout, str) else None,
        ("metadata x-request-priority", "metadata x-request-timeout-ms"),
    )
    remaining = context.time_remaining()  # None: the client set no deadline
    seconds = asked.timeout_s
    if remaining is not None:
        seconds = remaining if seconds is None else min(seconds, remaining)
    return Urgency(asked.priority, seconds)


def code_of(error: RequestError) -> grpc.StatusCode:
    return STATUS.get(answer_of(error).status, grpc.StatusCode.INTERNAL)


async def abort(
    context: grpc.aio.ServicerContext, state: ServiceState, error: RequestError
) -> None:
    """End the call with the error's status code and its HTTP message (counted as HTTP's)."""
    answer = answer_of(error)
    state.metrics.errors.labels(answer.error_type).inc()
    if answer.headers.get("Retry-After"):
        context.set_trailing_metadata((("retry-after", answer.headers["Retry-After"]),))
    await context.abort(code_of(error), error.message)


async def refuse(
    context: grpc.aio.ServicerContext, state: ServiceState, error: RequestError
) -> None:
    """End the call with `error` (`abort`); a stream's message raises it as `Refused` instead,
    for the stream's handler to end the call with (STREAMED)."""
    if STREAMED.get():
        raise Refused(error)
    await abort(context, state, error)


@contextlib.asynccontextmanager
async def admitted_call(
    state: ServiceState,
    context: grpc.aio.ServicerContext,
    route: str,
    size: int,
    batch: bool = False,
    stats: dict[str, Any] | None = None,
) -> AsyncIterator[Slot]:
    """A call's admission, as an HTTP POST of `size` bytes to `route`: its key checked, the
    refusals of that route (draining, in-flight cap, full queues), and an in-flight slot held
    until it is answered. `batch`: a client batch's part (a stream's message), which may wait
    past the in-flight cap as a client batch's body may. Counted in bertserve_requests_total
    under `grpc:<route>`. Traced (service.tracing) as an HTTP request is, its span continuing
    the `traceparent` metadata; `stats`: the dict the call gives `handle`."""
    started, perf = time.monotonic(), time.perf_counter()
    status, code = 200, "OK"
    slot: Slot | None = None
    span, tracing = None, state.tracing
    if tracing is not None:
        metadata = context.invocation_metadata() or ()
        carrier = {k: v for k, v in metadata if k in ("traceparent", "tracestate")}
        attributes = {"rpc.system": "grpc", "url.path": route}
        span = tracing.start(f"grpc {route}", carrier, attributes, perf)
        if stats is not None and span.is_recording():
            stats["span"], stats["tracing"] = span, tracing
    try:
        metadata = context.invocation_metadata() or ()
        given = [v.encode() for k, v in metadata if k == "authorization" and isinstance(v, str)]
        check_key(state.settings.keys(), given)
        if batch:  # admitted as a body that may queue (service.admission.may_queue)
            size = max(size, state.settings.queue_min_body_bytes)
        admitted = state.admit("POST", route, 0, size, given)
        if isinstance(admitted, RequestError):
            raise admitted
        slot = admitted
        slot.take()
        if slot.refused:
            raise state.admission.crowded
        yield slot
    except (RequestError, ValidationError) as exc:
        error = (
            InvalidInput(describe_validation(exc.errors()))
            if isinstance(exc, ValidationError)
            else exc
        )
        status = answer_of(error).status
        code = code_of(error).name
        await refuse(context, state, error)
    except grpc.aio.AbortError:
        raise
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:
        status, code = 500, "INTERNAL"
        log.exception("unhandled error in a gRPC call to %s", route)
        await refuse(context, state, RequestError("internal error (logged)"))
    finally:
        if slot is not None:
            slot.release()
        state.metrics.request_done(f"grpc:{route}", status, time.monotonic() - started)
        if span is not None:
            if stats is not None and "span" in stats:
                edge_spans(stats, perf, time.perf_counter())
            tracing.end(span, status, code)
