"""The HTTP endpoints: the task routes, generated from the registry (runtime/tasks/), each a
thin adapter over `handle`; and the operational ones (health, metrics, models)."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from runtime import schemas
from runtime.tasks import TASKS, Task
from service.asgi import disconnect_watch
from service.handler import handle
from service.state import ServiceState

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorBody, "description": text}
    for code, text in (
        (401, "missing or wrong bearer token"),
        (404, "no such model"),
        (413, "input or client batch too large"),
        (422, "invalid input"),
        (429, "overloaded: retry after Retry-After seconds"),
        (503, "not ready or draining"),
        (504, "queue deadline passed"),
    )
}
ModelName = Annotated[
    str | None,
    Query(description="bundle name; default: the bundle marked default for the task (GET /models)"),
]


def state_of(request: Request) -> ServiceState:
    return request.app.state.service


def task_route(task: Task):
    """A FastAPI endpoint for `task`: its body schema and response model come from the task, so
    the OpenAPI schema documents every task; the work is `handle`'s."""

    async def endpoint(request: Request, body: Any, model: Any = None) -> Response:
        answer = await handle(
            state_of(request),
            task,
            body,
            model,
            request.scope["state"],
            disconnect_watch(request.scope, request.receive),
        )
        return Response(answer, media_type="application/json")

    # FastAPI reads the parameters' types from the signature: give it the task's own.
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request
            ),
            inspect.Parameter(
                "body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=task.request
            ),
            inspect.Parameter(
                "model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=ModelName
            ),
        ]
    )
    endpoint.__name__ = task.path.strip("/").replace("/", "_").replace("-", "_")
    return endpoint


api = APIRouter(responses=ERROR_RESPONSES)
for _task in TASKS.values():
    api.add_api_route(
        _task.path,
        task_route(_task),
        methods=["POST"],
        response_model=_task.response,
        summary=_task.summary,
    )


ops = APIRouter()


# HEAD too: load balancers and uptime checkers probe with it.
@ops.api_route(
    "/health/live", methods=["GET", "HEAD"], responses={503: {"model": schemas.ErrorBody}}
)
async def live(request: Request) -> Response:
    """Fails once start-up has failed for good (a warm-up that raised), so that the
    orchestrator restarts the process instead of keeping one that will never be ready."""
    failed = state_of(request).dead
    if failed is not None:
        return JSONResponse({"error": f"not alive: {failed}", "error_type": "unavailable"}, 503)
    return JSONResponse({"status": "alive"})


@ops.api_route(
    "/health/ready", methods=["GET", "HEAD"], responses={503: {"model": schemas.ErrorBody}}
)
async def ready(request: Request) -> Response:
    state = state_of(request)
    providers = sorted({m.engine.provider for m in state.models.values()})
    if state.ready:
        return JSONResponse({"status": "ready", "providers": providers})
    reason = (
        "draining"
        if state.draining
        else state.dead
        or ("warming up" if not state.warmed else "a serving process or batching worker is down")
    )
    return JSONResponse({"error": f"not ready: {reason}", "error_type": "unavailable"}, 503)


@ops.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
)
async def metrics(request: Request) -> Response:
    state = state_of(request)
    text = state.metrics.scrape(state.settings.metrics_cache_s)
    return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)


@ops.get("/models")
async def models(request: Request) -> list[dict[str, Any]]:
    state = state_of(request)
    return [
        {
            "name": m.name,
            "tasks": m.spec.tasks,
            "default_for": [t for t, d in state.defaults.items() if d is m],
            "labels": m.spec.labels,
            "precision": m.spec.precision,
            "provider": m.engine.provider,
            "requested_provider": m.engine.requested,
            "max_seq_len": m.spec.max_seq_len,
            "architecture": m.spec.architecture.model_dump(),
            "metrics": m.spec.metrics,
            "weights": m.spec.source.init.model_dump() if m.spec.source.init else None,
            "queue_depth": m.batcher.depth,
        }
        for m in state.models.values()
    ]
