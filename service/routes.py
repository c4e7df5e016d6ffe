"""The HTTP endpoints: thin handlers that validate, tokenise, queue, and decode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service import schemas
from service.batching import Row, RowResult
from service.errors import InvalidInput, ServiceError, TooLarge, Unauthorized
from service.state import Model, ServiceState
from service.tasks import classify as classify_task
from service.tasks import fill_mask as fill_mask_task
from service.tasks import ner as ner_task
from service.tasks import nsp as nsp_task
from service.tasks import qa as qa_task

T = TypeVar("T")
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


class ClientGone(ServiceError):
    status, error_type = 499, "client_closed"


def state_of(request: Request) -> ServiceState:
    return request.app.state.service


async def require_key(request: Request) -> None:  # async: a sync dependency costs a thread hop
    key = state_of(request).settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {key.get_secret_value()}":
        raise Unauthorized(
            "send the API key as 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


def as_list(inputs: T | list[T], state: ServiceState) -> tuple[list[T], bool]:
    single = not isinstance(inputs, list)
    items: list[T] = list(inputs) if isinstance(inputs, list) else [inputs]
    if not items:
        raise InvalidInput("inputs is an empty list")
    if len(items) > state.settings.max_client_batch:
        raise TooLarge(
            f"{len(items)} inputs in one request; the limit is {state.settings.max_client_batch}"
        )
    return items, single


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def infer(request: Request, model: Model, rows: list[Row]) -> list[RowResult]:
    """Queue the rows; if the client goes away first, cancel them (they cost no compute)."""
    job = asyncio.ensure_future(model.batcher.submit(rows))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not job.done():
        job.cancel()
        raise ClientGone("client closed the connection")
    results = job.result()
    request.state.rows = len(rows)
    request.state.tokens = sum(len(r) for r in rows)
    if results:
        request.state.queue_ms = 1000 * max(r.queue_s for r in results)
        request.state.inference_ms = 1000 * max(r.inference_s for r in results)
    return results


async def run_task(
    request: Request,
    endpoint: str,
    model: Model,
    prepare: Callable[[], Sequence[Row]],
    finish: Callable[[list[RowResult]], Any],
) -> JSONResponse:
    state = state_of(request)
    stage = state.metrics.stages(endpoint)
    t0 = time.perf_counter()
    rows = list(prepare())
    t1 = time.perf_counter()
    settings = state.settings
    limit = min(settings.max_request_rows, settings.max_queue_rows)  # more could never be admitted
    if len(rows) > limit:  # a 100,000-token text: refused before it is queued or computed
        raise TooLarge(
            f"the input needs {len(rows)} sequences of up to {model.ctx.max_len} tokens; one "
            f"request may use {limit}. Send a shorter text or fewer inputs"
        )
    results = await infer(request, model, rows)
    t2 = time.perf_counter()
    body = finish(results)
    t3 = time.perf_counter()
    stage["tokenize"].observe(t1 - t0)
    for r in results[:1]:
        stage["queue"].observe(r.queue_s)
        stage["inference"].observe(r.inference_s)
    stage["postprocess"].observe(t3 - t2)
    return JSONResponse(body)


api = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)


@api.post(
    "/fill-mask",
    response_model=list[schemas.FillMaskItem]
    | list[list[schemas.FillMaskItem]]
    | list[list[list[schemas.FillMaskItem]]],
)
async def fill_mask(body: schemas.FillMaskRequest, request: Request, model: ModelName = None):
    state = state_of(request)
    m = state.model_for("fill-mask", model)
    texts, single = as_list(body.inputs, state)
    p = body.parameters
    targets = fill_mask_task.target_ids(m.ctx, p.targets)
    rows: list[Row] = []

    def prepare() -> list[Row]:
        rows.extend(fill_mask_task.preprocess(m.ctx, texts, p.truncation))
        return rows

    def finish(results: list[RowResult]) -> Any:
        out = fill_mask_task.postprocess(m.ctx, rows, results, p.top_k, targets)
        return out[0] if single else out

    return await run_task(request, "fill-mask", m, prepare, finish)


@api.post("/classify", response_model=list[schemas.LabelScore] | list[list[schemas.LabelScore]])
async def classify(body: schemas.ClassifyRequest, request: Request, model: ModelName = None):
    state = state_of(request)
    m = state.model_for("classify", model)
    texts, single = as_list(body.inputs, state)
    p = body.parameters

    def finish(results: list[RowResult]) -> Any:
        out = classify_task.postprocess(m.ctx, results, p.top_k, p.function_to_apply)
        return out[0] if single else out

    return await run_task(
        request, "classify", m, lambda: classify_task.preprocess(m.ctx, texts, p.truncation), finish
    )


@api.post("/ner", response_model=list[schemas.Entity] | list[list[schemas.Entity]])
async def ner(body: schemas.NerRequest, request: Request, model: ModelName = None):
    state = state_of(request)
    m = state.model_for("ner", model)
    texts, single = as_list(body.inputs, state)
    p = body.parameters
    prepared: list[Any] = []

    def prepare() -> list[Row]:
        inputs, rows = ner_task.preprocess(m.ctx, texts, p.stride)
        prepared.extend(inputs)
        return rows

    def finish(results: list[RowResult]) -> Any:
        out = ner_task.postprocess(
            m.ctx, prepared, results, p.aggregation_strategy, p.ignore_labels
        )
        return out[0] if single else out

    return await run_task(request, "ner", m, prepare, finish)


@api.post(
    "/qa",
    response_model=schemas.Answer
    | list[schemas.Answer]
    | list[schemas.Answer | list[schemas.Answer]],
)
async def qa(body: schemas.QaRequest, request: Request, model: ModelName = None):
    state = state_of(request)
    m = state.model_for("qa", model)
    items, single = as_list(body.inputs, state)
    p = body.parameters
    if p.doc_stride >= p.max_seq_len:
        raise InvalidInput(f"doc_stride {p.doc_stride} must be below max_seq_len {p.max_seq_len}")
    prepared: list[Any] = []

    def prepare() -> list[Row]:
        inputs, rows = qa_task.preprocess(
            m.ctx,
            [(i.question, i.context) for i in items],
            p.max_seq_len,
            p.doc_stride,
            p.max_question_len,
        )
        prepared.extend(inputs)
        return rows

    def finish(results: list[RowResult]) -> Any:
        out = qa_task.postprocess(
            m.ctx, prepared, results, p.top_k, p.max_answer_len, p.handle_impossible_answer
        )
        return out[0] if single else out

    return await run_task(request, "qa", m, prepare, finish)


@api.post("/nsp", response_model=schemas.NspResult | list[schemas.NspResult])
async def nsp(body: schemas.NspRequest, request: Request, model: ModelName = None):
    state = state_of(request)
    m = state.model_for("nsp", model)
    items, single = as_list(body.inputs, state)

    def finish(results: list[RowResult]) -> Any:
        out = nsp_task.postprocess(results)
        return out[0] if single else out

    return await run_task(
        request,
        "nsp",
        m,
        lambda: nsp_task.preprocess(
            m.ctx, [(i.text, i.text_pair) for i in items], body.parameters.truncation
        ),
        finish,
    )


ops = APIRouter()


@ops.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "alive"}


@ops.get("/health/ready", responses={503: {"model": schemas.ErrorBody}})
async def ready(request: Request) -> Response:
    state = state_of(request)
    if state.ready:
        return JSONResponse({"status": "ready"})
    reason = (
        "draining"
        if state.draining
        else "warming up"
        if not state.warmed
        else "a batching worker is down"
    )
    return JSONResponse({"error": f"not ready: {reason}", "error_type": "unavailable"}, 503)


@ops.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
)
async def metrics(request: Request) -> Response:
    return PlainTextResponse(
        generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


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
            "max_seq_len": m.spec.max_seq_len,
            "architecture": m.spec.architecture.model_dump(),
            "metrics": m.spec.metrics,
            "weights": m.spec.source.init.model_dump() if m.spec.source.init else None,
            "queue_depth": m.batcher.depth,
        }
        for m in state.models.values()
    ]
