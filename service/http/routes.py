"""The HTTP endpoints: the task routes, generated from the registry (runtime/tasks/), each a
thin adapter over `handle`; and the operational ones (health, metrics, models)."""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError

from bertserve.runtime import schemas
from bertserve.runtime.tasks import TASKS, Task, embed
from bertserve.runtime.tasks.common import TaskContext
from bertserve.service.admission import ROOT
from bertserve.service.handler import handle
from bertserve.service.http.asgi import admitted, disconnect_watch, urgency, user_agent
from bertserve.service.http.errors import (
    Forbidden,
    InvalidInput,
    NotFound,
    NotReady,
    TooLarge,
    openai_route,
)
from bertserve.service.http.fastpath import LARGE_BODY
from bertserve.service.models import Model
from bertserve.service.settings import Settings
from bertserve.service.state import ServiceState

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorBody, "description": text}
    for code, text in (
        (401, "missing or wrong bearer token"),
        (404, "no such model"),
        (413, "input or client batch too large"),
        (415, "a compressed body (Content-Encoding)"),
        (501, "a transfer coding besides chunked"),
        (422, "invalid input"),
        (429, "overloaded: retry after Retry-After seconds"),
        (503, "not ready or draining"),
        (504, "queue deadline passed"),
    )
}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(
        description="invalid_request_error, authentication_error, rate_limit_error or server_error"
    )
    param: str | None
    code: str = Field(description="the service's error_type")


class OpenAIErrorBody(BaseModel):
    """The error shape of the OpenAI routes (/v1/...): service.http.errors.error_body."""

    error: OpenAIErrorDetail


OPENAI_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {**answer, "model": OpenAIErrorBody} for code, answer in ERROR_RESPONSES.items()
}


def error_responses(path: str) -> dict[int | str, dict[str, Any]]:
    return OPENAI_ERROR_RESPONSES if openai_route(path) else ERROR_RESPONSES


ModelName = Annotated[
    str | None,
    Query(description="bundle name; default: the bundle marked default for the task (GET /models)"),
]


def state_of(request: Request) -> ServiceState:
    return request.app.state.service


def task_route(task: Task, body_type: Any = None, pick: Callable[[Any], Task] | None = None):
    """A FastAPI endpoint for `task`: its body schema and response model come from the task, so
    the OpenAPI schema documents every task; the work is `handle`'s. `body_type` and `pick`:
    an endpoint that takes several tasks' bodies and answers the one `pick(body)` names."""

    async def endpoint(request: Request, body: Any, model: Any = None) -> Response:
        answer = await handle(
            state_of(request),
            pick(body) if pick is not None else task,
            body,
            model,
            request.scope["state"],
            disconnect_watch(request.scope, request.receive),
            user_agent(request.scope),
            admitted(request.scope),
            urgency=urgency(request.scope),
        )
        return Response(answer, media_type="application/json")

    # FastAPI reads the parameters' types from the signature: give it the task's own.
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request
            ),
            inspect.Parameter(
                "body",
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=body_type or task.request,
            ),
            inspect.Parameter(
                "model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=ModelName
            ),
        ]
    )
    endpoint.__name__ = task.path.strip("/").replace("/", "_").replace("-", "_")
    return endpoint


def root_route(settings: Settings) -> APIRouter:
    """POST /: the root task (`root_task`, /embed by default), or /similarity for a body whose
    inputs hold a source_sentence, as text-embeddings-inference answers its base URL and as
    Hugging Face's InferenceClient posts to one."""
    root, similarity = TASKS[settings.root_task], TASKS["/similarity"]
    body_type: Any = root.request if root is similarity else root.request | similarity.request
    endpoint = task_route(
        root,
        body_type,
        lambda body: similarity if isinstance(body, similarity.request) else root,
    )
    endpoint.__name__ = "root"
    router = APIRouter(responses=ERROR_RESPONSES)
    router.add_api_route(
        ROOT,
        endpoint,
        methods=["POST"],
        response_model=root.response if root is similarity else root.response | list[float],
        summary=f"The root task ({settings.root_task}), or /similarity for similarity inputs",
    )
    return router


api = APIRouter()
for _task in TASKS.values():
    api.add_api_route(
        _task.path,
        task_route(_task),
        methods=["POST"],
        response_model=_task.response,
        summary=_task.summary,
        responses=error_responses(_task.path),
    )


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="first character in the input; null for special")
    stop: int | None = Field(description="one past the last character; null for special")


class TokenizeRequest(schemas.Request):
    inputs: embed.Texts
    add_special_tokens: bool = True
    prompt_name: embed.PromptName = None


class DecodeRequest(schemas.Request):
    ids: embed.TokenIds | Annotated[list[embed.TokenIds], Field(min_length=1)]
    skip_special_tokens: bool = True


def tokenizer_model(state: ServiceState, name: str | None) -> Model:
    """The model whose tokenizer /tokenize and /decode use: `?model=`, else the root task's
    default model."""
    if not state.models:
        raise NotReady("the service is starting: models are not loaded yet")
    if name is not None:
        found = state.models.get(name)
        if found is None:
            raise NotFound(f"no model {name!r}; models: {sorted(state.models)}")
        return found
    capability = TASKS[state.settings.root_task].capability
    return state.defaults.get(capability) or next(iter(state.models.values()))


def tokens(ctx: TaskContext, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    enc = ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    out = []
    for piece_id, piece, (start, stop), word in zip(
        enc.ids, enc.tokens, enc.offsets, enc.sequence_ids, strict=True
    ):
        special = word is None
        out.append(
            {
                "id": piece_id,
                "text": piece if special else text[start:stop],
                "special": special,
                "start": None if special else start,
                "stop": None if special else stop,
            }
        )
    return out


@api.post(
    "/tokenize",
    response_model=list[list[SimpleToken]],
    summary="Word pieces (TEI)",
    responses=ERROR_RESPONSES,
)
async def tokenize(request: Request, body: TokenizeRequest, model: ModelName = None) -> Response:
    """Each input's pieces with their offsets, as the model would see them
    (text-embeddings-inference's /tokenize)."""
    answer = await tokenize_answer(state_of(request), body, model)
    return Response(answer, media_type="application/json")


async def tokenize_answer(state: ServiceState, body: TokenizeRequest, model: str | None) -> bytes:
    """/tokenize's answer as JSON (also gRPC's Tokenize: service.grpc.tei)."""
    chosen = tokenizer_model(state, model)
    ctx, settings = chosen.ctx, state.settings
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if len(texts) > settings.max_client_batch:
        raise TooLarge(
            f"{len(texts)} inputs in one request; the limit is {settings.max_client_batch}"
        )
    texts = [embed.prompted(ctx, body.prompt_name, ctx.check_text(t)) for t in texts]

    def run() -> bytes:
        return orjson.dumps([tokens(ctx, t, body.add_special_tokens) for t in texts])

    heavy = sum(len(t) for t in texts) > settings.inline_cost
    return await asyncio.to_thread(run) if heavy else run()


# A body over fastpath's LARGE_BODY is parsed and validated on a worker thread, as the task
# routes' are: 2.8 MB of ids took 70-100 ms of the event loop in FastAPI's hands.
# Bodies a route reads itself (`decode_body`), so FastAPI does not list them: the document's
# components get them here (service.http.app), and contract.bind writes limits into them.
REF = "#/components/schemas/"
SELF_READ_BODIES: dict[str, type[BaseModel]] = {"DecodeRequest": DecodeRequest}


async def decode_body(request: Request) -> DecodeRequest:
    """/decode's body, read as FastAPI reads a JSON body (a JSON Content-Type, or none; the
    JSON decoded, then validated in Python mode), off the event loop when large."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if kind != "application/json" and not (
        kind.startswith("application/") and kind.endswith("+json")
    ):
        raise InvalidInput(f"the body must be JSON (Content-Type: application/json), not {kind}")
    raw = await request.body()

    def parse() -> DecodeRequest:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",)}]) from None
        try:
            return DecodeRequest.model_validate(data)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            raise RequestValidationError(errors) from None

    return await asyncio.to_thread(parse) if len(raw) > LARGE_BODY else parse()


@api.post(
    "/decode",
    response_model=list[str],
    summary="Text from token ids (TEI)",
    responses=ERROR_RESPONSES,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF + "DecodeRequest"}}},
        }
    },
)
async def decode(
    request: Request,
    body: Annotated[DecodeRequest, Depends(decode_body)],
    model: ModelName = None,
) -> Response:
    """Each list of ids as text (text-embeddings-inference's /decode)."""
    answer = await decode_answer(state_of(request), body, model)
    return Response(answer, media_type="application/json")


async def decode_answer(state: ServiceState, body: DecodeRequest, model: str | None) -> bytes:
    """/decode's answer as JSON (also gRPC's Decode: service.grpc.tei)."""
    ctx = tokenizer_model(state, model).ctx
    lists = [body.ids] if isinstance(body.ids[0], int) else body.ids
    if len(lists) > state.settings.max_client_batch:
        raise TooLarge(
            f"{len(lists)} inputs in one request; the limit is {state.settings.max_client_batch}"
        )
    vocab = ctx.spec.tokenizer.vocab_size
    for ids in lists:
        if len(ids) > ctx.max_text_chars:
            raise TooLarge(f"{len(ids)} ids in one input; the limit is {ctx.max_text_chars}")

    def run() -> bytes:
        for ids in lists:
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                raise InvalidInput(
                    f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})"
                )
        texts = ctx.tokenizer.decode_batch(lists, skip_special_tokens=body.skip_special_tokens)
        return orjson.dumps(texts)

    # Many ids take the event loop's thread for long: 3.4 MB of them took 0.23 s there,
    # and ten such requests held /health/live for 1.8 s (docs/security.md's bound is 50 ms).
    heavy = sum(len(ids) for ids in lists) > state.settings.inline_cost
    return await asyncio.to_thread(run) if heavy else run()


ops = APIRouter()


class OpenAIModel(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str


class OpenAIModelList(BaseModel):
    object: str = "list"
    data: list[OpenAIModel]


def openai_model(model: Model) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": int(dt.datetime.fromisoformat(model.spec.created_at).timestamp()),
        "owned_by": "bertserve",
    }


@ops.get(
    "/v1/models",
    summary="The loaded models, in OpenAI's list schema",
    response_model=OpenAIModelList,
)
async def openai_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"object": "list", "data": [openai_model(m) for m in state.models.values()]}


@ops.get(
    "/v1/models/{model_id}",
    summary="One loaded model, in OpenAI's schema (openai's models.retrieve)",
    response_model=OpenAIModel,
    responses={404: {"model": OpenAIErrorBody, "description": "no such model"}},
)
async def openai_model_by_id(request: Request, model_id: str) -> dict[str, Any]:
    found = state_of(request).models.get(model_id)
    if found is None:
        raise NotFound(f"no model {model_id!r}; models: {sorted(state_of(request).models)}")
    return openai_model(found)


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
    text = await state.metrics.scrape(state.settings.metrics_cache_s)
    return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)


@ops.get("/models")
async def models(request: Request) -> list[dict[str, Any]]:
    """The loaded models, each with its state and version; with explicit model control also
    those loading, unloading or failed (service.control)."""
    state = state_of(request)
    statuses = state.control.statuses
    loaded = [
        {
            "name": m.name,
            "state": statuses[m.name].state if m.name in statuses else "ready",
            "version": m.version,
            "reason": statuses[m.name].reason if m.name in statuses else None,
            "memory_mb": round(m.memory_mb, 1),
            "tasks": m.spec.tasks,
            "default_for": [t for t, d in state.defaults.items() if d is m],
            "labels": m.spec.labels,
            "precision": m.spec.precision,
            "provider": m.engine.provider,
            "requested_provider": m.engine.requested,
            "engine": m.engine.engine_name,
            "engine_choice": m.engine.engine_choice or None,
            "max_seq_len": m.spec.max_seq_len,
            "mask_token": m.spec.tokenizer.mask_token if "fill-mask" in m.spec.tasks else None,
            "prompts": m.spec.prompts,
            "default_prompt_name": m.spec.default_prompt_name,
            "architecture": m.spec.architecture.model_dump(),
            "metrics": m.spec.metrics,
            "weights": m.spec.source.init.model_dump() if m.spec.source.init else None,
            "queue_depth": m.batcher.depth,
        }
        for m in state.models.values()
    ]
    others = [
        {"name": name, "state": status.state, "version": status.version, "reason": status.reason}
        for name, status in statuses.items()
        if name not in state.models
    ]
    return loaded + others


MANAGEMENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorBody, "description": text}
    for code, text in (
        (401, "no admin key, or a wrong one"),
        (403, "an API key, not an admin key; or no admin keys set (the API is off)"),
        (404, "the repository holds no such bundle, or (unload) it is not loaded"),
        (409, "model control is static"),
        (422, "the bundle could not be loaded or warmed: the reason"),
        (500, "another worker could not follow: the reason"),
        (504, "not every worker finished within model_load_timeout_s"),
    )
}


@ops.post(
    "/models/{name}/load",
    summary="Load a bundle of the repository, or replace the loaded one of that name",
    responses=MANAGEMENT_RESPONSES,
)
async def load_model(request: Request, name: str) -> dict[str, Any]:
    """Loads the bundle `name` in every worker, warms it, then serves it; a loaded model of
    that name keeps answering until its replacement is warm, then drains and is freed. Answers
    once every worker has made the change. An admin key only (BERTSERVE_ADMIN_KEYS)."""
    admin_only(request)
    return await state_of(request).control.load(name)


@ops.post(
    "/models/{name}/unload",
    summary="Stop serving a model: it answers what it admitted, then is freed",
    responses=MANAGEMENT_RESPONSES,
)
async def unload_model(request: Request, name: str) -> dict[str, Any]:
    """A request for it is then a 404 naming what is served. An admin key only."""
    admin_only(request)
    return await state_of(request).control.unload(name)


def admin_only(request: Request) -> None:
    """The management routes' own check, behind the middleware's (service.http.app)."""
    if not request.scope.get("state", {}).get("admin"):
        raise Forbidden("the model management API takes an admin key (BERTSERVE_ADMIN_KEYS)")
