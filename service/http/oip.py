"""The Open Inference Protocol v2 over REST (KServe's and Triton's HTTP/REST API): health,
server and model metadata, model readiness and inference, with Triton's binary tensor data
extension (what `tritonclient.http` sends and asks for by default). The tensors and what they
mean are service/oip.py's; errors are `{"error": message}` with the JSON routes' messages,
400 for a request the protocol calls invalid (where the JSON routes answer 422)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Receive, Scope

from bertserve.runtime import schemas
from bertserve.service import oip
from bertserve.service.http.asgi import admitted, disconnect_watch, urgency, user_agent
from bertserve.service.http.errors import (
    InvalidInput,
    RequestError,
    answer_of,
    describe_validation,
    error_body,
    internal_error_response,
)
from bertserve.service.state import ServiceState

HEADER_LENGTH = "inference-header-content-length"
JSON = "application/json"
BINARY = "application/octet-stream"


class RequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: Any = None


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferenceRequest(BaseModel):
    """OIP's $inference_request (the JSON part, with the binary extension)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    # KServe's REST client sends them beside the path that names the model: read, not used.
    model_name: str | None = None
    model_version: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


# The statuses these routes answer with, documented as the JSON routes' are ({"error": ...}).
RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorBody, "description": text}
    for code, text in (
        (400, "invalid request: wrong tensors, or input"),
        (401, "missing or wrong bearer token"),
        (404, "no such model or version"),
        (413, "input or client batch too large"),
        (415, "a compressed body (Content-Encoding)"),
        (429, "overloaded: retry after Retry-After seconds"),
        (501, "a transfer coding besides chunked"),
        (503, "not ready or draining"),
        (504, "queue deadline passed"),
    )
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": schemas.ErrorBody, "description": "not live, or not ready"}
}
router = APIRouter(tags=["Open Inference Protocol v2"])


def _state(request: Request) -> ServiceState:
    return request.app.state.service


def oip_error(error: RequestError, state: ServiceState) -> Response:
    answer = answer_of(error)
    state.metrics.errors.labels(answer.error_type).inc()
    status = 400 if answer.status == 422 else answer.status
    body = error_body(error.message, answer.error_type, status, "/v2/")
    return Response(body, status, headers=answer.headers, media_type=JSON)


@router.get("/v2", summary="Server metadata", responses=RESPONSES)
async def server_metadata() -> JSONResponse:
    return JSONResponse(oip.server_metadata(oip.VERSION))


@router.get("/v2/health/live", summary="Server liveness (200: live)", responses=HEALTH_RESPONSES)
async def server_live(request: Request) -> Response:
    state = _state(request)
    if state.dead is not None:
        return JSONResponse({"live": False, "error": f"not alive: {state.dead}"}, 503)
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="Server readiness (200: ready)", responses=HEALTH_RESPONSES)
async def server_ready(request: Request) -> Response:
    if _state(request).ready:
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "error": "not ready (GET /health/ready says why)"}, 503)


@router.get(
    "/v2/models/{name}", summary="Model metadata", responses=RESPONSES, operation_id="oip_metadata"
)
@router.get(
    "/v2/models/{name}/versions/{version}",
    summary="Model metadata at a version",
    responses=RESPONSES,
    operation_id="oip_metadata_at_version",
)
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    state = _state(request)
    try:
        return JSONResponse(oip.metadata(oip.endpoint(state, name, version)))
    except RequestError as error:
        return oip_error(error, state)


@router.get(
    "/v2/models/{name}/ready",
    summary="Model readiness (200: ready)",
    responses=RESPONSES,
    operation_id="oip_ready",
)
@router.get(
    "/v2/models/{name}/versions/{version}/ready",
    summary="Model readiness at a version",
    responses=RESPONSES,
    operation_id="oip_ready_at_version",
)
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    state = _state(request)
    try:
        found = oip.endpoint(state, name, version)
    except RequestError as error:
        return oip_error(error, state)
    ready = state.ready
    return JSONResponse({"name": found.name, "ready": ready}, 200 if ready else 503)


@router.post(
    "/v2/models/{name}/infer",
    summary="Inference (JSON, or Triton's binary tensor data extension)",
    responses=RESPONSES,
    operation_id="oip_infer",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                JSON: {"schema": InferenceRequest.model_json_schema()},
                BINARY: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
@router.post(
    "/v2/models/{name}/versions/{version}/infer",
    include_in_schema=False,
    operation_id="oip_infer_at_version",
)
async def model_infer(request: Request, name: str, version: str | None = None) -> Response:
    return await infer_response(
        _state(request),
        request.scope,
        request.receive,
        await request.body(),
        request.headers.get(HEADER_LENGTH),
        name,
        version,
    )


async def infer_response(
    state: ServiceState,
    scope: Scope,
    receive: Receive,
    raw: bytes,
    header_length: str | None,
    name: str,
    version: str | None,
) -> Response:
    """An inference's response: for the FastAPI route, and for the fast path
    (service.http.fastpath), which answers a POST to an infer path without FastAPI."""
    try:
        found = oip.endpoint(state, name, version)
        parsed, tensors = parse(raw, header_length)
        asked = [o.name for o in parsed.outputs] if parsed.outputs is not None else None
        outputs = await oip.infer(
            state,
            found,
            tensors,
            parsed.parameters,
            asked,
            scope.setdefault("state", {}),
            disconnected=disconnect_watch(scope, receive),
            client=user_agent(scope),
            slot=admitted(scope),
            urgency=urgency(scope),
        )
    except ValidationError as exc:
        return oip_error(InvalidInput(describe_validation(exc.errors())), state)
    except RequestError as error:
        return oip_error(error, state)
    except Exception:
        return internal_error_response(state.metrics, "/v2/")
    return respond(found, parsed, outputs)


def parse(raw: bytes, header_length: str | None) -> tuple[InferenceRequest, list[oip.Tensor]]:
    """The request's JSON part and its input tensors, their data from JSON or, with the binary
    extension, from the bytes after the JSON (in the inputs' order)."""
    if header_length is None:
        size = len(raw)
    else:
        try:
            size = int(header_length)
        except ValueError:
            raise InvalidInput(
                f"Inference-Header-Content-Length {header_length!r} is not a number"
            ) from None
        if not 0 < size <= len(raw):
            raise InvalidInput(
                f"Inference-Header-Content-Length {size} is not within the body's {len(raw)} bytes"
            )
    try:
        data = orjson.loads(raw[:size])
    except orjson.JSONDecodeError:
        raise InvalidInput("the inference request's header is not valid JSON (UTF-8)") from None
    parsed = InferenceRequest.model_validate(data)
    tail, at, tensors = memoryview(raw)[size:], 0, []
    for item in parsed.inputs:
        binary = item.parameters.get("binary_data_size")
        if binary is not None:
            if not isinstance(binary, int) or binary < 0 or at + binary > len(tail):
                raise InvalidInput(
                    f"input {item.name!r}: binary_data_size {binary!r} is past the body's end"
                )
            tensors.append(
                oip.from_bytes(item.name, item.datatype, item.shape, tail[at : at + binary])
            )
            at += binary
        elif item.data is None:
            raise InvalidInput(f"input {item.name!r} has neither data nor binary_data_size")
        else:
            tensors.append(oip.from_json(item.name, item.datatype, item.shape, item.data))
    if at != len(tail):
        raise InvalidInput(f"{len(tail) - at} bytes after the inputs' binary data")
    return parsed, tensors


def respond(found: oip.Endpoint, parsed: InferenceRequest, outputs: list[oip.Tensor]) -> Response:
    """The inference response: outputs in JSON, or those asked binary after the JSON part."""
    everything_binary = bool(parsed.parameters.get("binary_data_output", False))
    asked = {o.name: o.parameters for o in parsed.outputs or []}
    head, tail = [], []
    for tensor in outputs:
        binary = asked.get(tensor.name, {}).get("binary_data", everything_binary)
        item: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": tensor.shape,
        }
        if binary:
            data = oip.to_bytes(tensor)
            item["parameters"] = {"binary_data_size": len(data)}
            tail.append(data)
        else:
            item["data"] = oip.to_json(tensor)
        head.append(item)
    answer: dict[str, Any] = {
        "model_name": found.name,
        "model_version": found.model.version,
        "outputs": head,
    }
    if parsed.id is not None:
        answer["id"] = parsed.id
    body = orjson.dumps(answer)
    if not tail:
        return Response(body, media_type=JSON)
    return Response(
        body + b"".join(tail),
        media_type=BINARY,
        headers={"Inference-Header-Content-Length": str(len(body))},
    )
