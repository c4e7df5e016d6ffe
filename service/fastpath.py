"""The task endpoints without FastAPI's per-request machinery, for the requests that need none of
it: a JSON body, at most a `model` query parameter.

FastAPI's routing, dependency solving and body handling were about a third of the event loop's
time per request at saturation (docs/performance.md), and the event loop is what limits the
service. This layer decodes and validates the body itself and calls the same route functions,
so answers, errors and their messages are the same (tests/service/test_behaviour.py compares
the two paths); anything unusual (another content type, an empty body or one that is not JSON,
other query parameters) goes on to FastAPI unchanged. The OpenAPI schema still comes from the
FastAPI routes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from service import routes, schemas
from service.asgi import replaying
from service.errors import (
    ServiceError,
    internal_error_response,
    service_error_response,
    validation_error_response,
)
from service.state import ServiceState

Handler = Callable[[Any, Request, str | None], Awaitable[Response]]
ROUTES: dict[str, tuple[type[BaseModel], Handler]] = {
    "/fill-mask": (schemas.FillMaskRequest, routes.fill_mask),
    "/classify": (schemas.ClassifyRequest, routes.classify),
    "/ner": (schemas.NerRequest, routes.ner),
    "/qa": (schemas.QaRequest, routes.qa),
    "/nsp": (schemas.NspRequest, routes.nsp),
}
JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")


class FastPath:
    def __init__(self, app: ASGIApp, state: ServiceState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
        if content_type.lower() not in JSON_TYPES or any(k != "model" for k, _ in query):
            return await self.app(scope, receive, send)
        first = await receive()  # BodyLimit (outside) hands the whole body in one message
        body = first.get("body", b"") if first["type"] == "http.request" else b""
        replay = replaying(first, receive)
        if not body.strip() or len(query) > 1:
            return await self.app(scope, replay, send)
        schema, handler = route
        try:
            data = json.loads(body)
        except ValueError:  # not JSON, or not UTF-8: FastAPI words that error
            return await self.app(scope, replay, send)
        request = Request(scope, replay)
        response: Response
        try:
            await routes.require_key(request)  # before validation, as FastAPI: no schema hints
            try:
                # Python mode on the decoded JSON, as FastAPI does: pydantic's JSON mode words
                # some errors differently ("valid array" for "valid list").
                parsed = schema.model_validate(data)
            except ValidationError as exc:
                response = validation_error_response(exc.errors(), self.state.metrics)
                return await response(scope, replay, send)
            response = await handler(parsed, request, query[0][1] if query else None)
        except ServiceError as exc:
            response = service_error_response(exc, self.state.metrics)
        except Exception:
            response = internal_error_response(self.state.metrics)
        await response(scope, replay, send)
