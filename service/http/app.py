"""`create_app(settings)`: the FastAPI app, its lifespan (load bundles, warm up, stop), the ASGI
middleware (body limit, request id, metrics, JSON access log) and the one error mapping."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bertserve.runtime.tasks import TASKS
from bertserve.service.grpc import server as grpc
from bertserve.service.http.asgi import ADMITTED, ARRIVED, SAFE_ID, replaying
from bertserve.service.http.auth import (
    MANAGEMENT,
    MANAGEMENT_PREFIX,
    PUBLIC_PATHS,
    authorizations,
    check_admin,
    check_key,
)
from bertserve.service.http.contract import bind
from bertserve.service.http.docs import mount_docs
from bertserve.service.http.errors import (
    HttpError,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    RequestError,
    Unauthorized,
    UnsupportedEncoding,
    UnsupportedTransferCoding,
    answer_of,
    error_response,
    internal_error_response,
    service_error_response,
    validation_error_response,
)
from bertserve.service.http.fastpath import FastPath
from bertserve.service.http.oip import router as oip_router
from bertserve.service.http.routes import REF, SELF_READ_BODIES, api, ops, root_route
from bertserve.service.metrics import Metrics
from bertserve.service.settings import Settings
from bertserve.service.state import ServiceState
from bertserve.service.tracing import Tracing, edge_spans, start_tracing

log = logging.getLogger("bertserve.access")
ENDPOINTS = {
    *TASKS,
    *("/", "/tokenize", "/decode", "/v1/models"),
    *("/health/live", "/health/ready", "/metrics", "/models"),
}
# A retiring worker (replaced for its memory) closes each connection after its answer.
RETIRING_HEADERS: dict[bool, tuple[tuple[bytes, bytes], ...]] = {
    False: (),
    True: ((b"connection", b"close"),),
}


def codings_of(scope: Scope, header: bytes, understood: tuple[str, ...] = ()) -> list[str]:
    """The codings every `header` of the request lists, less identity and `understood`."""
    known = {"identity", *understood}
    return [
        c.strip()
        for k, v in scope["headers"]
        if k == header
        for c in v.decode("latin-1").split(",")
        if c.strip() and c.strip().lower() not in known
    ]


# The body codings refused: the header, its error, the codings understood, what to send.
CODINGS: tuple[tuple[bytes, type[HttpError], tuple[str, ...], str], ...] = (
    (
        b"transfer-encoding",
        UnsupportedTransferCoding,
        ("chunked",),
        "uncompressed, chunked or with a Content-Length",
    ),
    (b"content-encoding", UnsupportedEncoding, (), "uncompressed"),
)
# The seconds a body may take before it must keep up BERTSERVE_BODY_MIN_RATE.
BODY_GRACE_S = 5.0


class BodyLimit:
    """Refuse bodies over the limit before reading them (Content-Length) or as soon as the
    streamed bytes pass it (chunked), so a 10 MB body never sits in memory.

    The body is read here, up to the limit, and handed on whole: raising from inside the app's
    own `receive` would not do, because FastAPI turns any error while reading a body into a
    422 "error parsing the body". Later `receive` calls (the route's disconnect watch) go to the
    server as before."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        timeout: float,
        crowded: Callable[[str], ASGIApp] | None = None,
        min_rate: float = 0.0,
    ) -> None:
        """`crowded`: the answer (for a request's path) to a request whose body completed with
        every in-flight slot taken (service.state.Slot). `min_rate`: bytes/s a body must keep
        up after BODY_GRACE_S (0: only `timeout` bounds it)."""
        self.app, self.limit, self.timeout, self.crowded = app, limit, timeout, crowded
        self.min_rate = min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            # Only the task routes (POST) read a body: a GET that declares one is answered
            # without waiting for it, so it cannot hold the request open.
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        path = scope["path"]
        message = f"request body is over the limit of {self.limit:,} bytes"
        too_large = error_response(413, "too_large", message, path=path)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_large(scope, receive, send)
        # The server reads chunked framing only, not what is inside it; a gzip body is not JSON.
        for header, error, understood, send_it in CODINGS:
            codings = codings_of(scope, header, understood)
            if codings:
                named = f"{header.decode().title()} {', '.join(codings)}"
                message = f"{named} is not supported: send the body {send_it}"
                refused = error_response(error.status, error.error_type, message, path=path)
                return await refused(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        # One deadline for the whole body (a body sent a byte at a time, or shorter than its
        # Content-Length, ends here), BODY_GRACE_S plus a second a min_rate bytes, at most
        # `timeout`. asyncio.timeout, not wait_for: no task per receive().
        start = asyncio.get_running_loop().time()
        end = start + self.timeout

        def deadline() -> float:
            return min(end, start + BODY_GRACE_S + size / self.min_rate) if self.min_rate else end

        try:
            async with asyncio.timeout_at(deadline()) as bound:
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":  # the client left before the body was in
                        return None
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > self.limit:
                        return await too_large(scope, receive, send)
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
                    bound.reschedule(deadline())
        except TimeoutError:
            slow = f"the request body did not arrive within {self.timeout:g} s"
            if deadline() < end:
                slow = (
                    f"the request body arrived slower than {self.min_rate:g} bytes/s "
                    f"({size:,} bytes in {asyncio.get_running_loop().time() - start:.1f} s)"
                )
            response = error_response(408, "timeout", slow, {"Connection": "close"}, path)
            return await response(scope, receive, send)
        slot = scope.get("extensions", {}).get(ADMITTED)
        if slot is not None and slot.refused and self.crowded is not None:
            # Its body completed when every in-flight slot was taken (service.state.Slot).
            return await self.crowded(path)(scope, receive, send)
        whole: Message = {"type": "http.request", "body": b"".join(chunks)}
        await self.app(scope, replaying(whole, receive), send)


class RequestContext:
    """X-Request-ID in and out, the API key (checked before a body is read), load shedding,
    in-flight gauge, request counter and latency by endpoint, and one JSON log line a request
    (id, endpoint, status, rows, tokens, queue and inference ms)."""

    def __init__(self, app: ASGIApp, state: ServiceState) -> None:
        self.app, self.state = app, state
        self.keys = state.settings.keys()
        self.admin_keys = state.settings.admin_key_set()
        token = state.settings.metrics_token
        self.metrics_keys = (token.get_secret_value().encode(),) if token is not None else ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        # 32 random hex digits, as uuid4().hex gave, from the process's own generator (seeded
        # from the OS at start): uuid4's getrandom() system call was where the loop lost its
        # core, 7% of its profile at saturation (docs/reports/floor.md). An id, not a secret.
        request_id = given if SAFE_ID.fullmatch(given) else f"{random.getrandbits(128):032x}"
        state = scope.setdefault("state", {})
        state["request_id"], state[ARRIVED] = request_id, time.monotonic()
        status = 500
        started = time.perf_counter()

        async def send_with_id(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg["headers"] = [
                    *msg.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                    *RETIRING_HEADERS[self.state.retiring],
                ]
            await send(msg)

        metrics = self.state.metrics
        app = self.app
        # The gate (service.admission) is the protocol's (service.http.protocol): what reaches the
        # app was admitted there, with its Slot (service.state), which holds an in-flight slot
        # from its complete body until it is answered. The probes and /metrics answer from
        # memory and hold no slot: no number of them can crowd out keyed work. Then the API
        # key, before the body is read.
        path = scope["path"]
        slot = scope.get("extensions", {}).get(ADMITTED)
        keys = self.metrics_keys if path == "/metrics" else self.keys
        if scope["method"] == "POST" and path.startswith(MANAGEMENT_PREFIX):
            try:
                check_admin(self.admin_keys, self.keys, authorizations(scope["headers"]))
                scope["state"]["admin"] = True  # the management routes check it again
            except RequestError as exc:
                app = service_error_response(exc, metrics, path)
        elif keys and (path not in PUBLIC_PATHS or path == "/metrics"):
            try:
                check_key(keys, authorizations(scope["headers"]))
            except Unauthorized as exc:
                app = service_error_response(exc, metrics, path)
        tracing, span = self.state.tracing, None
        if tracing is not None and path not in PUBLIC_PATHS:
            span = self.start_span(tracing, scope, request_id, started)
        try:
            await app(scope, receive, send_with_id)
        finally:
            if slot is not None:
                slot.release()
            elapsed = time.perf_counter() - started
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else other_endpoint(path)
            if span is not None:
                if "span" in scope["state"]:  # recorded: its children, from the times measured
                    edge_spans(scope["state"], started, time.perf_counter())
                tracing.end(span, status)
            metrics.request_done(endpoint, status, elapsed if scope["method"] == "POST" else None)
            extra = scope["state"]
            fields = {
                "request_id": request_id,
                "method": scope["method"],
                "endpoint": endpoint,
                "status": status,
                "ms": round(1000 * elapsed, 3),
                **{
                    k: round(v, 3) if isinstance(v, float) else v
                    for k, v in extra.items()
                    if k in ("rows", "tokens", "queue_ms", "inference_ms", "model", "tenant")
                },
            }
            if span is not None:
                fields["trace_id"] = format(span.get_span_context().trace_id, "032x")
            # The dict travels on the record: the JSON formatter encodes it once; any other
            # handler still gets a readable message.
            log.info("%s %s %d", scope["method"], endpoint, status, extra={"fields": fields})

    @staticmethod
    def start_span(tracing: Tracing, scope: Scope, request_id: str, at: float) -> Any:
        """The request's span, continuing the caller's traceparent; recorded (sampled), it
        goes into the request's state for the handler's child spans."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate")
        }
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else other_endpoint(path)
        span = tracing.start(
            f"{scope['method']} {endpoint}",
            carrier,
            {
                "http.request.method": scope["method"],
                "url.path": path,
                "bertserve.request_id": request_id,
            },
            at,
        )
        if span.is_recording():
            scope["state"]["span"], scope["state"]["tracing"] = span, tracing
        return span


OIP_MODEL = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?(/ready|/infer)?")


def other_endpoint(path: str) -> str:
    """The endpoint label of a path outside ENDPOINTS: the management API's by its route."""
    found = MANAGEMENT.fullmatch(path)
    if found:
        return f"/models/{{name}}/{found.group(1)}"
    found = OIP_MODEL.fullmatch(path)  # the Open Inference Protocol's, by model and route
    return f"/v2/models/{{name}}{found.group(2) or ''}" if found else "other"


def count_refusal(state: ServiceState, path: str, error: RequestError) -> None:
    """A request the protocol refused (service.http.protocol): counted as the middleware counts
    its answers; not logged line by line (at 5x overload that is tens of thousands a second)."""
    answer = answer_of(error)
    state.metrics.errors.labels(answer.error_type).inc()
    state.metrics.request_done(
        path if path in ENDPOINTS else other_endpoint(path), answer.status, None
    )


class ServiceApp(FastAPI):
    """FastAPI with the service's own middleware in front of FastAPI's stack, not inside it.

    Starlette builds every `add_middleware` layer inside its own error and telemetry layers,
    which cost each request a few calls and a look-up of OpenTelemetry's providers in the
    environment (docs/performance.md). In front, a task request that the fast path
    answers never enters FastAPI; everything else goes on to it as before. An exception that
    escapes a route is still answered by FastAPI's error layer (`bug` below), now through
    `RequestContext`, so its 500 carries the request id."""

    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document with this deployment's limits written in (service.http.contract),
        kept once the models are loaded; before that, the static document, not kept."""
        if self.openapi_schema is not None:
            return self.openapi_schema
        schema = super().openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, body in SELF_READ_BODIES.items():
            document = body.model_json_schema(ref_template=REF + "{model}")
            for nested, part in document.pop("$defs", {}).items():  # its own models, beside it
                components.setdefault(nested, part)
            components.setdefault(name, document)
        state = self.state.service
        if not state.models:
            self.openapi_schema = None
            return schema
        self.openapi_schema = bind(schema, state.settings, state.models)
        return self.openapi_schema


def create_app(settings: Settings) -> ServiceApp:
    state = ServiceState(settings, Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.tracing = start_tracing(settings)
        await state.start()
        grpc_server = await grpc.start(state)
        try:
            yield
        finally:
            # The drain (service.process.server) waited for the admitted calls of both ports.
            await grpc.stop(grpc_server, 1.0)
            await state.stop()
            if state.tracing is not None:  # what is left is exported
                await asyncio.to_thread(state.tracing.shutdown)

    app = ServiceApp(
        title="bertserve",
        version="0.1.0",
        lifespan=lifespan,
        description="BERT-class NLU behind a dynamic-batching queue on ONNX Runtime.",
        docs_url=None,  # served from the package's own assets: mount_docs
        redoc_url=None,
    )
    # "/classify/" is a 404, not a redirect whose Location is built from the Host header.
    app.router.redirect_slashes = False
    app.state.service = state
    state.control.changed.append(lambda: setattr(app, "openapi_schema", None))
    app.include_router(api)
    app.include_router(root_route(settings))
    app.include_router(ops)
    app.include_router(oip_router)
    mount_docs(app)

    @app.exception_handler(RequestError)
    async def service_error(request: Request, exc: RequestError) -> Response:
        return service_error_response(exc, state.metrics, request.scope["path"])

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return validation_error_response(exc.errors(), state.metrics, request.scope["path"])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own errors (malformed body, unknown path, wrong method) as typed errors,
        # so they are answered and counted as the service's are.
        error: RequestError
        if exc.status_code == 400:
            error = InvalidInput(str(exc.detail))
        else:
            kind = {404: NotFound, 405: MethodNotAllowed}.get(exc.status_code, HttpError)
            error = kind(str(exc.detail), getattr(exc, "headers", None))
            if kind is HttpError:
                error.status = exc.status_code
        return service_error_response(error, state.metrics, request.scope["path"])

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:
        return internal_error_response(state.metrics, request.scope["path"])

    framework = super(ServiceApp, app).__call__
    fast = FastPath(framework, state)  # innermost: after the body limit
    limited = BodyLimit(
        fast,
        limit=settings.max_body_bytes,
        timeout=settings.body_timeout_s,
        min_rate=settings.body_min_rate,
        crowded=lambda path: service_error_response(state.admission.crowded, state.metrics, path),
    )
    app.front = RequestContext(limited, state)  # outermost: sees every response
    return app
