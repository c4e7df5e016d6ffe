"""KServe's own inference clients (the `kserve` SDK's InferenceRESTClient and
InferenceGRPCClient, protocol v2) against a running bertserve: run in .venv-triton by
tests/service/frontdoors/test_oip.py as
`python kserve_jobs.py HTTP_URL GRPC_HOST:PORT CASES.json`. Prints one JSON line a case: each
client's readiness and outputs, decoded."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest
from kserve.inference_client import RESTConfig


def decoded(array: np.ndarray) -> list:
    flat = np.asarray(array).reshape(-1)
    if flat.dtype == object or flat.dtype.kind in "SU":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


def request(case: dict) -> InferRequest:
    inputs = []
    for name, texts in case["inputs"].items():
        tensor = InferInput(name=name, shape=[len(texts)], datatype="BYTES")
        tensor.set_data_from_numpy(np.asarray(texts, dtype=object), binary_data=False)
        inputs.append(tensor)
    return InferRequest(
        model_name=case["model"], infer_inputs=inputs, parameters=case.get("parameters")
    )


async def main() -> None:
    http_url, grpc_url = sys.argv[1], sys.argv[2]
    with open(sys.argv[3]) as f:
        cases = json.load(f)
    rest = InferenceRESTClient(RESTConfig(protocol="v2"))
    grpc = InferenceGRPCClient(grpc_url)
    ready = [await rest.is_server_ready(http_url), await grpc.is_server_ready()]
    print(json.dumps({"server_ready": ready}))
    for case in cases:
        out = {"model": case["model"]}
        answer = await rest.infer(http_url, request(case), model_name=case["model"])
        out["rest"] = {o.name: decoded(o.as_numpy()) for o in answer.outputs}
        answer = await grpc.infer(request(case))
        out["grpc"] = {o.name: decoded(o.as_numpy()) for o in answer.outputs}
        print(json.dumps(out))
    await rest.close()
    await grpc.close()


if __name__ == "__main__":
    asyncio.run(main())
