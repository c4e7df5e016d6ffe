"""The gRPC server: one `grpc.aio` server a serving process, on `BERTSERVE_GRPC_PORT` beside
the HTTP port, in the same event loop, over the same models, batchers and limits. Several
workers bind the one port (SO_REUSEPORT), as they share the HTTP socket.

A call is admitted as an HTTP request to its JSON route is (`admitted_call`: the same caps,
429s and drain), authenticated by its `authorization` metadata (`Bearer <key>`, as HTTP),
answered by the same `handle`, and refused with the gRPC status code of its HTTP status
(`STATUS`). The standard health service (`grpc.health.v1`) says SERVING while the service is
ready; reflection is served when `BERTSERVE_GRPC_REFLECTION` is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

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
        admitted = state.admit("POST", route, 0, size)
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
        await abort(context, state, error)
    except grpc.aio.AbortError:
        raise
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:
        status, code = 500, "INTERNAL"
        log.exception("unhandled error in a gRPC call to %s", route)
        await abort(context, state, RequestError("internal error (logged)"))
    finally:
        if slot is not None:
            slot.release()
        state.metrics.request_done(f"grpc:{route}", status, time.monotonic() - started)
        if span is not None:
            if stats is not None and "span" in stats:
                edge_spans(stats, perf, time.perf_counter())
            tracing.end(span, status, code)


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING while the service is ready (as GET /health/ready), for the
    server ("") and each service it serves."""

    def __init__(self, state: ServiceState, services: list[str]) -> None:
        self.state, self.services = state, {"", *services}

    def _status(self, service: str) -> int:
        if service not in self.services:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        if self.state.ready:
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self._status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        last = None
        while True:
            status = self._status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(0.5)


Adder = Callable[[grpc.aio.Server, ServiceState], Awaitable[str] | str]


async def start(state: ServiceState) -> grpc.aio.Server | None:
    """The gRPC server on `grpc_port` (None: no gRPC), started; its services: the Open
    Inference Protocol's and TEI's (service.grpc.oip, service.grpc.tei), health, reflection
    if asked."""
    settings = state.settings
    if settings.grpc_port is None:
        return None
    from bertserve.service.grpc import oip, tei

    limit = settings.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", max(settings.max_response_bytes, limit) + 65536),
            ("grpc.so_reuseport", 1),
        ],
    )
    names = [oip.add(server, state), *tei.add(server, state)]
    health_pb2_grpc.add_HealthServicer_to_server(Health(state, names), server)
    if settings.grpc_reflection:
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            [
                *names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
    address = f"{settings.host}:{settings.grpc_port}"
    state.grpc_port = server.add_insecure_port(address)
    await server.start()
    log.info("gRPC serving %s on %s:%d", ", ".join(names), settings.host, state.grpc_port)
    return server


async def stop(server: grpc.aio.Server | None, grace_s: float) -> None:
    if server is not None:
        await server.stop(grace_s)
