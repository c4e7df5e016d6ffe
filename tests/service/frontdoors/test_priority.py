"""A request's priority and its own timeout, through every front door: the X-Request-Priority and
X-Request-Timeout-Ms headers on the JSON routes, the `priority` body field where a schema has
one (Cohere's, vLLM's), Triton's `priority` and `timeout` parameters on the Open Inference
Protocol, gRPC metadata and the call's deadline. Bad values are refused as any invalid
input is (422 on the JSON routes, 400 on the OIP's, INVALID_ARGUMENT on gRPC), naming what to
send; a timeout that passes gets a 504, never a late 200.
How the batcher orders and drops rows is tests/runtime/test_batching.py's."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from bertserve.service.grpc import grpc_predict_v2_pb2 as pb
from bertserve.service.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from bertserve.service.grpc import tei_pb2 as tei
from bertserve.service.grpc import tei_pb2_grpc as tei_grpc
from tests.helpers.server import free_port, live_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    from bertserve.export.bundle import build_bundle

    root: Path = tmp_path_factory.mktemp("priority-bundles")
    build_bundle(checkpoints["BertForSequenceClassification"], ["classify"], root / "sentiment")
    build_bundle(checkpoints["BertForPreTraining"], ["embed"], root / "embedder")
    with live_server(bundles=root, grpc_port=free_port()) as live:
        yield live


def infer_body(**parameters):
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["a film"]}]}
    return body | ({"parameters": parameters} if parameters else {})


def test_priorities_and_timeouts_are_accepted_where_each_protocol_carries_them(server):
    with server.client() as c:
        header = c.post(
            "/classify",
            json={"inputs": "a fine film"},
            headers={"X-Request-Priority": "7", "X-Request-Timeout-Ms": "20000"},
        )
        cohere = c.post("/v2/embed", json={"texts": ["a"], "priority": 3, "model": "embedder"})
        vllm = c.post("/v1/embeddings", json={"input": "a", "priority": 2})
        oip = c.post("/v2/models/sentiment/infer", json=infer_body(priority=5, timeout=20_000_000))
    assert [r.status_code for r in (header, cohere, vllm, oip)] == [200] * 4
    with grpc.insecure_channel(f"127.0.0.1:{server.state.grpc_port}") as channel:
        answer = tei_grpc.EmbedStub(channel).Embed(
            tei.EmbedRequest(inputs="a"),
            metadata=[("x-request-priority", "9"), ("x-request-timeout-ms", "20000")],
            timeout=20,
        )
    assert len(answer.embeddings) > 0


def test_bad_priorities_and_timeouts_are_refused_with_what_to_send(server):
    with server.client() as c:
        word = c.post("/classify", json={"inputs": "a"}, headers={"X-Request-Priority": "high"})
        high = c.post("/classify", json={"inputs": "a"}, headers={"X-Request-Priority": "1000"})
        underscore = c.post(
            "/classify", json={"inputs": "a"}, headers={"X-Request-Priority": "1_0"}
        )
        zero = c.post("/embed", json={"inputs": "a"}, headers={"X-Request-Timeout-Ms": "0"})
        nan = c.post("/embed", json={"inputs": "a"}, headers={"X-Request-Timeout-Ms": "nan"})
        cohere = c.post("/v2/embed", json={"texts": ["a"], "priority": 1000})
        vllm = c.post("/v1/embeddings", json={"input": "a", "priority": -1})
        oip_priority = c.post("/v2/models/sentiment/infer", json=infer_body(priority="soon"))
        oip_timeout = c.post("/v2/models/sentiment/infer", json=infer_body(timeout=-5))
    range_text = "X-Request-Priority must be an integer from 0 (served first) to 999"
    assert word.status_code == 422 and word.json()["error"].startswith(range_text)
    assert high.status_code == 422 and "got '1000'" in high.json()["error"]
    assert underscore.status_code == 422
    for response in (zero, nan):
        assert response.status_code == 422
        assert (
            "X-Request-Timeout-Ms must be a positive number of milliseconds"
            in (response.json()["error"])
        )
    assert cohere.status_code == 422 and vllm.status_code == 422
    assert oip_priority.status_code == 400
    assert oip_priority.json()["error"].startswith("parameter priority must be an integer")
    assert oip_timeout.status_code == 400
    assert "parameter timeout must be positive (microseconds)" in oip_timeout.json()["error"]
    address = f"127.0.0.1:{server.state.grpc_port}"
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as failed:
        tei_grpc.EmbedStub(channel).Embed(
            tei.EmbedRequest(inputs="a"), metadata=[("x-request-priority", "-3")]
        )
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.details().startswith("metadata x-request-priority must be an integer")


def test_a_timeout_that_passes_is_a_504_never_a_late_answer(server):
    """A timeout far shorter than any answer: 504 on every door, the route's own wording."""
    with server.client() as c:
        late = c.post("/classify", json={"inputs": "a"}, headers={"X-Request-Timeout-Ms": "1e-3"})
        oip = c.post("/v2/models/sentiment/infer", json=infer_body(timeout=1))
    assert late.status_code == 504 and "X-Request-Timeout-Ms" in late.json()["error"]
    assert oip.status_code == 504
    with grpc.insecure_channel(f"127.0.0.1:{server.state.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as failed:
            tei_grpc.EmbedStub(channel).Embed(
                tei.EmbedRequest(inputs="a"), metadata=[("x-request-timeout-ms", "0.001")]
            )
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline" in failed.value.details()
        request = pb.ModelInferRequest(
            model_name="sentiment",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name="TEXT", datatype="BYTES", shape=[1])
            ],
            raw_input_contents=[(6).to_bytes(4, "little") + b"a film"],
            parameters={"timeout": pb.InferParameter(int64_param=1)},
        )
        with pytest.raises(grpc.RpcError) as failed:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
