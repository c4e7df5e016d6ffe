"""The Open Inference Protocol v2, REST and gRPC: Triton's own clients (tritonclient.http and
tritonclient.grpc) and KServe's SDK (from .venv-triton: `make triton`) answer with the JSON
routes' numbers for every task; bad input gets the protocol's error codes with the JSON
routes' messages; health, metadata and readiness per model; nothing admitted over gRPC is lost
when the service drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

from bertserve.service.grpc import grpc_predict_v2_pb2 as pb
from bertserve.service.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from tests.helpers.checkpoints import cross_encoder
from tests.helpers.server import free_port, live_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
PYTHON = Path(os.environ.get("BERTSERVE_TRITON_PYTHON", ROOT / ".venv-triton" / "bin" / "python"))
KEY = "an-api-key-of-16-chars"
TEXTS = ["the river runs past old mills", "john lives in paris"]
CASES = [
    {"model": "sst2-minilm", "inputs": {"TEXT": TEXTS}},
    {"model": "entities", "inputs": {"TEXT": TEXTS}},
    {"model": "squad", "inputs": {"QUESTION": ["who lives in paris"], "CONTEXT": [TEXTS[1]]}},
    {"model": "pretrained", "inputs": {"TEXT": ["the [MASK] runs past old mills"]}},
    {"model": "pretrained.nsp", "inputs": {"TEXT": TEXTS[:1], "TEXT_PAIR": TEXTS[1:]}},
    {"model": "embedder", "inputs": {"TEXT": TEXTS}, "parameters": {"normalize": False}},
    {"model": "ranker", "inputs": {"QUERY": ["where is john"], "TEXT": TEXTS}},
]


@pytest.fixture(scope="module")
def bundles(checkpoints, tmp_path_factory) -> Path:
    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("oip-bundles")
    for name, arch, tasks in (
        ("pretrained", "BertForPreTraining", ["fill-mask", "nsp"]),
        ("sst2-minilm", "BertForSequenceClassification", ["classify"]),
        ("entities", "BertForTokenClassification", ["ner"]),
        ("squad", "BertForQuestionAnswering", ["qa"]),
        ("embedder", "BertForPreTraining", ["embed"]),
    ):
        build_bundle(checkpoints[arch], tasks, root / name)
    build_bundle(cross_encoder(tmp_path_factory.mktemp("ce")), ["rerank"], root / "ranker")
    return root


@pytest.fixture(scope="module")
def server(bundles):
    with live_server(bundles=bundles, grpc_port=free_port(), max_client_batch=8) as live:
        yield live


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.state.grpc_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def json_answers(server) -> dict[str, list]:
    """Each case as its JSON route answers it."""
    with server.client() as c:
        post = lambda path, body: c.post(path, json=body).json()  # noqa: E731
        return {
            "sst2-minilm": post("/classify", {"inputs": TEXTS}),
            "entities": post("/ner", {"inputs": TEXTS}),
            "squad": post(
                "/qa", {"inputs": [{"question": "who lives in paris", "context": TEXTS[1]}]}
            ),
            "pretrained": post("/fill-mask", {"inputs": ["the [MASK] runs past old mills"]}),
            "pretrained.nsp": post("/nsp", {"inputs": [{"text": TEXTS[0], "text_pair": TEXTS[1]}]}),
            "embedder": post("/embed", {"inputs": TEXTS, "normalize": False}),
            "ranker": post("/rerank", {"query": "where is john", "texts": TEXTS}),
        }


def test_triton_clients_answer_as_the_json_routes(server, tmp_path):
    if not PYTHON.exists():
        message = f"no Triton clients' virtualenv at {PYTHON}: run `make triton`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CASES))
    run = subprocess.run(
        [
            str(PYTHON),
            str(ROOT / "tests" / "triton" / "jobs.py"),
            server.url.removeprefix("http://"),
            f"127.0.0.1:{server.state.grpc_port}",
            str(cases),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines[0] == {"server_ready": [True, True]}
    got = {line["model"]: line for line in lines[1:]}
    expected = json_answers(server)
    for model, want in expected.items():
        for client in ("http", "grpc"):
            answer = got[model][client]
            out = answer["outputs"]
            assert answer["ready"] is True
            # JSON: each input's answer exactly as its route gives it (rerank: in input order)
            if model == "ranker":
                by_index = {r["index"]: r for r in want}
                assert [json.loads(j) for j in out["JSON"]] == [by_index[0], by_index[1]]
                scores = [by_index[i]["score"] for i in range(2)]
                assert np.allclose(out["SCORE"], scores, atol=1e-6)
                continue
            assert [json.loads(j) for j in out["JSON"]] == want, (model, client)
            if model == "sst2-minilm":
                assert out["LABEL"] == [w[0]["label"] for w in want]
                assert np.allclose(out["SCORE"], [w[0]["score"] for w in want], atol=1e-6)
            elif model == "embedder":
                assert answer["shapes"]["EMBEDDING"] == [2, 32]
                assert np.array_equal(
                    np.asarray(out["EMBEDDING"], np.float32).reshape(2, 32),
                    np.asarray(want, np.float32),
                )
            elif model == "squad":
                assert out["ANSWER"] == [w["answer"] for w in want]
                assert out["START"] == [w["start"] for w in want]
                assert out["END"] == [w["end"] for w in want]
            elif model == "pretrained.nsp":
                assert out["IS_NEXT"] == [w["is_next"] for w in want]
                assert np.allclose(out["SCORE"], [w["score"] for w in want], atol=1e-6)
            elif model == "pretrained":
                assert out["TOKEN_STR"] == [i["token_str"] for i in want[0]]
                assert np.allclose(out["SCORE"], [i["score"] for i in want[0]], atol=1e-6)


def text_tensor(name, texts, datatype="BYTES", shape=None):
    return {"name": name, "datatype": datatype, "shape": shape or [len(texts)], "data": texts}


def test_bad_requests_get_the_protocols_codes_and_the_json_routes_messages(server, stub):
    with server.client() as c:
        unknown = c.post("/v2/models/nope/infer", json={"inputs": [text_tensor("TEXT", ["a"])]})
        dtype = c.post(
            "/v2/models/sst2-minilm/infer",
            json={"inputs": [text_tensor("TEXT", [1.0], "FP32")]},
        )
        shape = c.post(
            "/v2/models/sst2-minilm/infer",
            json={"inputs": [text_tensor("TEXT", ["a", "b"], shape=[1, 2])]},
        )
        name = c.post(
            "/v2/models/sst2-minilm/infer", json={"inputs": [text_tensor("WORDS", ["a"])]}
        )
        empty = c.post(
            "/v2/models/sst2-minilm/infer", json={"inputs": [text_tensor("TEXT", [" "])]}
        )
        json_empty = c.post("/classify", json={"inputs": [" "]})
        many = c.post(
            "/v2/models/sst2-minilm/infer", json={"inputs": [text_tensor("TEXT", ["a"] * 9)]}
        )
        json_many = c.post("/classify", json={"inputs": ["a"] * 9})
        output = c.post(
            "/v2/models/sst2-minilm/infer",
            json={"inputs": [text_tensor("TEXT", ["a"])], "outputs": [{"name": "LOGITS"}]},
        )
        version = c.get("/v2/models/sst2-minilm/versions/0")
        metrics = c.get("/metrics").text
    assert unknown.status_code == 404 and "served: " in unknown.json()["error"]
    assert dtype.status_code == 400 and "datatype BYTES" in dtype.json()["error"]
    assert shape.status_code == 400 and "[N] or [N, 1]" in shape.json()["error"]
    assert name.status_code == 400 and "no input 'WORDS'" in name.json()["error"]
    assert empty.status_code == 400 and json_empty.status_code == 422
    assert empty.json()["error"] == json_empty.json()["error"]
    assert many.status_code == json_many.status_code == 413
    assert many.json()["error"] == json_many.json()["error"]
    assert output.status_code == 400 and "outputs: LABEL, SCORE, JSON" in output.json()["error"]
    assert version.status_code == 404
    assert 'endpoint="/v2/models/{name}/infer",status="404"' in metrics

    def infer(model, datatype="BYTES", data=(b"a",)):
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="TEXT", datatype=datatype, shape=[len(data)]
        )
        raw = b"".join(len(d).to_bytes(4, "little") + d for d in data)
        request = pb.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[raw])
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(request)
        return failed.value

    assert infer("nope").code() == grpc.StatusCode.NOT_FOUND
    assert infer("sst2-minilm", data=(b" ",)).details() == json_empty.json()["error"]
    assert infer("sst2-minilm", data=(b" ",)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert infer("sst2-minilm", data=(b"a",) * 9).details() == json_many.json()["error"]
    bad = infer("sst2-minilm", data=(b"\xff",))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in bad.details()


def test_health_metadata_and_readiness(server, stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with server.client() as c:
        assert c.get("/v2/health/live").json() == {"live": True}
        assert c.get("/v2/health/ready").json() == {"ready": True}
        meta = c.get("/v2/models/embedder").json()
        assert c.get("/v2/models/pretrained.nsp/ready").json()["ready"] is True
        assert c.get("/v2").json()["extensions"] == ["binary_tensor_data"]
    assert meta["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"][0] == {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 32]}
    assert meta["parameters"] == {"task": "embed", "route": "/embed"}
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ModelReady(pb.ModelReadyRequest(name="ranker")).ready
    grpc_meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="ranker"))
    assert [(t.name, list(t.shape)) for t in grpc_meta.inputs] == [("QUERY", [1]), ("TEXT", [-1])]
    with grpc.insecure_channel(f"127.0.0.1:{server.state.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService", "tei.v1.Embed"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_calls_need_the_api_key_as_http_requests_do(bundles):
    with live_server(bundles=bundles, grpc_port=free_port(), api_keys=KEY) as live:
        with grpc.insecure_channel(f"127.0.0.1:{live.state.grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            tensor = pb.ModelInferRequest.InferInputTensor(
                name="TEXT", datatype="BYTES", shape=[1], contents={"bytes_contents": [b"a b"]}
            )
            request = pb.ModelInferRequest(model_name="sst2-minilm", inputs=[tensor])
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(request)
            answer = stub.ModelInfer(request, metadata=[("authorization", f"Bearer {KEY}")])
        with live.client() as c:
            metrics = c.get("/metrics").text
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [o.name for o in answer.outputs] == ["LABEL", "SCORE", "JSON"]
    assert 'endpoint="grpc:/classify",status="200"' in metrics


def test_sigterm_answers_every_grpc_call_it_admitted(bundles):
    """Two serving processes share the gRPC port (SO_REUSEPORT) as they share HTTP's. Calls
    waiting in the batch window when SIGTERM comes are answered; a call after it is refused
    UNAVAILABLE; the exit status is 0."""
    from tests.service.process.test_process import start, wait_ready

    port, grpc_port = free_port(), free_port()
    process = start(
        bundles, port, max_wait_ms=1500, drain_timeout_s=20, workers=2, grpc_port=grpc_port
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", process)

        async def load():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                calls = [
                    asyncio.ensure_future(stub.ModelInfer(infer_request(f"sentence {i}")))
                    for i in range(16)
                ]
                await asyncio.sleep(0.5)  # all sent, waiting in the batch window
                process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.1)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as fresh:
                    try:
                        await pb_grpc.GRPCInferenceServiceStub(fresh).ModelInfer(
                            infer_request("after the signal"), timeout=10
                        )
                        late = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as error:
                        late = error.code()
                return await asyncio.gather(*calls), late

        answers, late = asyncio.run(load())
        assert [a.model_name for a in answers] == ["sst2-minilm"] * 16
        assert late == grpc.StatusCode.UNAVAILABLE
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()


def infer_request(text: str) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="TEXT", datatype="BYTES", shape=[1], contents={"bytes_contents": [text.encode()]}
    )
    return pb.ModelInferRequest(model_name="sst2-minilm", inputs=[tensor])


def test_the_documented_client_snippet_runs(server):
    """docs/api.md's tritonclient block, against this server's ports."""
    if not PYTHON.exists():
        pytest.skip(f"no Triton clients' virtualenv at {PYTHON}: run `make triton`")
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## Open Inference Protocol v2", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    port = server.url.rsplit(":", 1)[1]
    block = block.replace("localhost:8000", f"127.0.0.1:{port}")
    block = block.replace("localhost:8001", f"127.0.0.1:{server.state.grpc_port}")
    run = subprocess.run([str(PYTHON), "-c", block], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    with server.client() as c:
        want = c.post("/classify", json={"inputs": ["a gripping film", "a dull mess"]}).json()
    printed = "[" + " ".join(f"b'{w[0]['label']}'" for w in want) + "]"  # numpy's bytes array
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith(printed) for line in lines), (printed, lines)


def test_kserve_clients_answer_as_the_json_routes(server, tmp_path):
    """KServe's SDK (InferenceRESTClient and InferenceGRPCClient, v2): the same outputs as
    the JSON routes for every task."""
    if not PYTHON.exists():
        message = f"no Triton clients' virtualenv at {PYTHON}: run `make triton`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CASES))
    run = subprocess.run(
        [
            str(PYTHON),
            str(ROOT / "tests" / "triton" / "kserve_jobs.py"),
            server.url,
            f"127.0.0.1:{server.state.grpc_port}",
            str(cases),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines[0] == {"server_ready": [True, True]}
    expected = json_answers(server)
    for line in lines[1:]:
        want = expected[line["model"]]
        for client in ("rest", "grpc"):
            out = line[client]
            got = [json.loads(j) for j in out["JSON"]]
            if line["model"] == "ranker":
                by_index = {r["index"]: r for r in want}
                assert got == [by_index[0], by_index[1]]
                continue
            assert got == want, (line["model"], client)
            if line["model"] == "embedder":
                assert np.allclose(np.asarray(out["EMBEDDING"]).reshape(2, 32), want)
