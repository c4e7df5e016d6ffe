"""The Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`): the same models,
tensors and answers as the REST routes (service/oip.py, service/http/oip.py). Input data come
in `raw_input_contents` (what tritonclient.grpc sends) or in `contents`; outputs go out in
`raw_output_contents`, as Triton answers."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from bertserve.service import oip
from bertserve.service.grpc import grpc_predict_v2_pb2 as pb
from bertserve.service.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from bertserve.service.grpc.calls import abort, admitted_call, urgency
from bertserve.service.http.errors import InvalidInput, RequestError
from bertserve.service.oip import VERSION
from bertserve.service.state import ServiceState

SERVICE = "inference.GRPCInferenceService"
CONTENTS = {
    "BOOL": "bool_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def parameters_of(params: Any) -> dict[str, Any]:
    """A protobuf map<string, InferParameter> as plain values."""
    out = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def tensors_of(request: Any) -> list[oip.Tensor]:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: one each, or none"
        )
    tensors = []
    for i, item in enumerate(request.inputs):
        shape = list(item.shape)
        if raw:
            tensors.append(oip.from_bytes(item.name, item.datatype, shape, raw[i]))
            continue
        field = CONTENTS.get(item.datatype)
        if field is None:
            raise InvalidInput(
                f"input {item.name!r}: datatype {item.datatype!r} is not served here"
            )
        values = list(getattr(item.contents, field))
        if item.datatype == "BYTES":
            data = np.asarray(values, dtype=object)
            count = int(np.prod(shape)) if shape else 1
            if data.size != count:
                raise InvalidInput(
                    f"input {item.name!r} has shape {shape} but {data.size} elements"
                )
            tensors.append(oip.Tensor(item.name, item.datatype, shape, data))
        else:
            tensors.append(oip.from_json(item.name, item.datatype, shape, values))
    return tensors


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self.state.dead is None)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(**oip.server_metadata(VERSION))

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            oip.endpoint(self.state, request.name, request.version or None)
        except RequestError as error:
            await abort(context, self.state, error)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            found = oip.endpoint(self.state, request.name, request.version or None)
        except RequestError as error:
            await abort(context, self.state, error)
        meta = oip.metadata(found)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        state = self.state
        try:
            found = oip.endpoint(state, request.model_name, request.model_version or None)
        except RequestError as error:
            await abort(context, state, error)
        route = found.signature.route
        stats: dict[str, Any] = {}
        async with admitted_call(state, context, route, request.ByteSize(), stats=stats) as slot:
            tensors = tensors_of(request)
            asked = [o.name for o in request.outputs] or None
            outputs = await oip.infer(
                state,
                found,
                tensors,
                parameters_of(request.parameters),
                asked,
                stats,
                slot=slot,
                urgency=urgency(context),
            )
            return pb.ModelInferResponse(
                model_name=found.name,
                model_version=found.model.version,
                id=request.id,
                outputs=[
                    pb.ModelInferResponse.InferOutputTensor(
                        name=t.name, datatype=t.datatype, shape=t.shape
                    )
                    for t in outputs
                ],
                raw_output_contents=[oip.to_bytes(t) for t in outputs],
            )


def add(server: grpc.aio.Server, state: ServiceState) -> str:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(state), server)
    return SERVICE
