"""The task endpoints without FastAPI's per-request machinery, for the requests that need none of
it: a JSON body, at most a `model` query parameter.

FastAPI's routing, dependency solving and body handling were a large share of the event loop's time
per request at saturation, and the event loop is what limits the service
(docs/performance.md#choices-and-the-measurement-behind-each). This adapter decodes the JSON itself
and calls the same `handle` as the FastAPI routes, so answers, errors and their messages are the
same (tests/service/test_behaviour.py compares the two paths); anything unusual (another content
type, an empty body or one that is not JSON, other query parameters) goes on to FastAPI unchanged.
The API key was checked before the body was read, by the outermost middleware, for both paths alike.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import parse_qsl, unquote

from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bertserve.runtime.tasks import TASKS
from bertserve.service.admission import ROOT, root_task
from bertserve.service.handler import handle
from bertserve.service.http.asgi import (
    admitted,
    disconnect_watch,
    replaying,
    urgency,
    user_agent,
)
from bertserve.service.http.errors import (
    RequestError,
    internal_error_response,
    service_error_response,
    validation_error_response,
)
from bertserve.service.http.oip import infer_response
from bertserve.service.oip import INFER_PATH
from bertserve.service.state import ServiceState

HEADER_LENGTH = b"inference-header-content-length"

JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")
LARGE_BODY = 256_000  # bytes: parsed and validated off the event loop


class FastPath:
    def __init__(self, app: ASGIApp, state: ServiceState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else None
        if path is not None and path.startswith("/v2/models/") and scope["method"] == "POST":
            infer = INFER_PATH.fullmatch(path)
            if infer is not None:  # the Open Inference Protocol's, without FastAPI
                return await self._infer(scope, receive, send, infer.group(1), infer.group(2))
        if (path not in TASKS and path != ROOT) or scope["method"] != "POST":
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
        large = len(body) > LARGE_BODY
        try:
            # A client batch's body (up to 4 MB) parses on a worker thread: json.loads of the
            # 3.6 MB /classify body of bench attack took 12 ms of the event loop.
            data = await asyncio.to_thread(json.loads, body) if large else json.loads(body)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep:
            return await self.app(scope, replay, send)  # FastAPI words that error

        task = TASKS[path] if path != ROOT else root_task(data, self.state.settings)
        response: Response
        try:
            if large:
                data = await asyncio.to_thread(task.request.model_validate, data)
            # Python mode on the decoded JSON, as FastAPI does: pydantic's JSON mode words
            # some errors differently ("valid array" for "valid list").
            answer = await handle(
                self.state,
                task,
                data,
                query[0][1] if query else None,
                scope.setdefault("state", {}),
                disconnect_watch(scope, replay),
                user_agent(scope),
                admitted(scope),
                urgency=urgency(scope),
            )
            response = Response(answer, media_type="application/json")
        except ValidationError as exc:
            response = validation_error_response(exc.errors(), self.state.metrics, path)
        except RequestError as exc:
            response = service_error_response(exc, self.state.metrics, path)
        except Exception:
            response = internal_error_response(self.state.metrics, path)
        await response(scope, replay, send)

    async def _infer(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        first = await receive()  # BodyLimit (outside) hands the whole body in one message
        body = first.get("body", b"") if first["type"] == "http.request" else b""
        replay = replaying(first, receive)
        header = next((v for k, v in scope["headers"] if k == HEADER_LENGTH), None)
        response = await infer_response(
            self.state,
            scope,
            replay,
            body,
            header.decode("latin-1") if header is not None else None,
            unquote(name),
            unquote(version) if version is not None else None,
        )
        await response(scope, replay, send)
