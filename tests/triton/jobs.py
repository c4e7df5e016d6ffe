"""Triton's own Python clients against a running bertserve: run in .venv-triton by
tests/service/frontdoors/test_oip.py as
`python jobs.py HTTP_HOST:PORT GRPC_HOST:PORT CASES.json`. For each case (a model and its
input texts by tensor name) it calls get_model_metadata and infer with tritonclient.http
(binary tensors, the client's default) and tritonclient.grpc, and prints one JSON line:
readiness, metadata and every output, decoded, from each client."""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def decoded(array: np.ndarray) -> list:
    if array.dtype == object:
        return [v.decode("utf-8") for v in array.reshape(-1)]
    return array.reshape(-1).tolist()


def run(module, client, case: dict) -> dict:
    inputs = []
    for name, texts in case["inputs"].items():
        tensor = module.InferInput(name, [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.asarray([t.encode() for t in texts], dtype=object))
        inputs.append(tensor)
    meta = client.get_model_metadata(case["model"])
    if module is grpcclient:  # a protobuf message: its outputs' names
        outputs = [o.name for o in meta.outputs]
    else:
        outputs = [o["name"] for o in meta["outputs"]]
    result = client.infer(case["model"], inputs, parameters=case.get("parameters"))
    return {
        "ready": client.is_model_ready(case["model"]),
        "outputs": {name: decoded(result.as_numpy(name)) for name in outputs},
        "shapes": {name: list(result.as_numpy(name).shape) for name in outputs},
    }


def main() -> None:
    http_url, grpc_url = sys.argv[1], sys.argv[2]
    with open(sys.argv[3]) as f:
        cases = json.load(f)
    http = httpclient.InferenceServerClient(http_url)
    grpc = grpcclient.InferenceServerClient(grpc_url)
    print(json.dumps({"server_ready": [http.is_server_ready(), grpc.is_server_ready()]}))
    for case in cases:
        print(
            json.dumps(
                {
                    "model": case["model"],
                    "http": run(httpclient, http, case),
                    "grpc": run(grpcclient, grpc, case),
                }
            )
        )


if __name__ == "__main__":
    main()
