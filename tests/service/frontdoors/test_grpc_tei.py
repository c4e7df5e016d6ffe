"""text-embeddings-inference's gRPC services (tei.v1), called through stubs that grpcio-tools
generates from the project's proto: every RPC, the streams included, answers as its JSON route
answers the same request; errors carry the JSON route's message under TEI's status codes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from bertserve.service.grpc import tei_pb2 as pb
from bertserve.service.grpc import tei_pb2_grpc as pb_grpc
from tests.helpers.checkpoints import cross_encoder
from tests.helpers.server import free_port, live_server

pytestmark = pytest.mark.slow
TEXTS = ["the river runs past old mills", "john lives in paris", "a grey sea"]
QUERY = "where does john live"


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("tei-bundles")
    build_bundle(checkpoints["BertForPreTraining"], ["embed"], root / "embedder")
    build_bundle(checkpoints["BertForPreTraining"], ["sparse"], root / "splade")
    build_bundle(checkpoints["BertForSequenceClassification"], ["classify"], root / "sentiment")
    build_bundle(cross_encoder(tmp_path_factory.mktemp("ce")), ["rerank"], root / "ranker")
    with live_server(
        bundles=root, grpc_port=free_port(), max_client_batch=8, max_response_bytes=2_000_000
    ) as live:
        yield live


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.state.grpc_port}") as channel:
        yield channel


def post(server, path, body):
    with server.client() as c:
        response = c.post(path, json=body)
    return response


def test_info_names_the_default_model_and_the_limits(server, channel):
    info = pb_grpc.InfoStub(channel).Info(pb.InfoRequest())
    assert (info.model_id, info.model_type) == ("embedder", pb.MODEL_TYPE_EMBEDDING)
    assert info.model_sha == server.state.models["embedder"].version
    assert info.max_client_batch_size == 8
    assert info.max_input_length == server.state.models["embedder"].spec.max_seq_len
    ranker = pb_grpc.InfoStub(channel).Info(pb.InfoRequest(), metadata=[("model", "ranker")])
    assert (ranker.model_id, ranker.model_type) == ("ranker", pb.MODEL_TYPE_RERANKER)


def test_embed_unary_and_streamed_answers_are_the_json_routes(server, channel):
    stub = pb_grpc.EmbedStub(channel)
    dense = post(server, "/embed", {"inputs": TEXTS, "normalize": True}).json()
    one = stub.Embed(pb.EmbedRequest(inputs=TEXTS[0], normalize=True))
    # (a lone call and a batch of three may differ in the last float32 place)
    assert np.allclose(one.embeddings, dense[0], atol=1e-6)
    assert one.metadata.compute_tokens > 0 and one.metadata.total_time_ns > 0
    assert one.metadata.compute_chars == len(TEXTS[0])
    # each stage measured, none longer than the whole call
    stages = (one.metadata.tokenization_time_ns, one.metadata.inference_time_ns)
    assert all(0 < ns <= one.metadata.total_time_ns for ns in stages)
    streamed = list(
        stub.EmbedStream(iter(pb.EmbedRequest(inputs=t, normalize=True) for t in TEXTS))
    )
    assert np.allclose([r.embeddings for r in streamed], dense, atol=1e-6)

    raw = post(server, "/embed", {"inputs": TEXTS[1], "normalize": False}).json()
    assert np.allclose(stub.Embed(pb.EmbedRequest(inputs=TEXTS[1])).embeddings, raw[0])

    sparse = post(server, "/embed_sparse", {"inputs": TEXTS}).json()
    got = stub.EmbedSparse(pb.EmbedSparseRequest(inputs=TEXTS[0]), metadata=[("model", "splade")])
    assert [v.index for v in got.sparse_embeddings] == [v["index"] for v in sparse[0]]
    assert np.allclose([v.value for v in got.sparse_embeddings], [v["value"] for v in sparse[0]])
    streamed = list(stub.EmbedSparseStream(iter(pb.EmbedSparseRequest(inputs=t) for t in TEXTS)))
    assert [[v.index for v in r.sparse_embeddings] for r in streamed] == [
        [v["index"] for v in s] for s in sparse
    ]

    states = post(server, "/embed_all", {"inputs": TEXTS}).json()
    every = stub.EmbedAll(pb.EmbedAllRequest(inputs=TEXTS[2]))
    assert np.allclose([t.embeddings for t in every.token_embeddings], states[2])
    streamed = list(stub.EmbedAllStream(iter(pb.EmbedAllRequest(inputs=t) for t in TEXTS)))
    assert [len(r.token_embeddings) for r in streamed] == [len(s) for s in states]


def test_predict_and_rerank_answer_as_classify_and_rerank(server, channel):
    labels = post(server, "/classify", {"inputs": TEXTS, "parameters": {"top_k": None}}).json()
    predict = pb_grpc.PredictStub(channel)
    one = predict.Predict(pb.PredictRequest(inputs=TEXTS[0]))
    assert [p.label for p in one.predictions] == [x["label"] for x in labels[0]]
    assert np.allclose([p.score for p in one.predictions], [x["score"] for x in labels[0]])
    streamed = list(predict.PredictStream(iter(pb.PredictRequest(inputs=t) for t in TEXTS)))
    assert [[p.label for p in r.predictions] for r in streamed] == [
        [x["label"] for x in item] for item in labels
    ]
    with pytest.raises(grpc.RpcError) as pair:
        predict.PredictPair(pb.PredictPairRequest(inputs=TEXTS[:2]))
    assert pair.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Rerank" in pair.value.details()

    ranked = post(server, "/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True}).json()
    rerank = pb_grpc.RerankStub(channel)
    got = rerank.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS, return_text=True))
    assert [(r.index, r.text) for r in got.ranks] == [(r["index"], r["text"]) for r in ranked]
    assert np.allclose([r.score for r in got.ranks], [r["score"] for r in ranked])
    pairs = iter(pb.RerankStreamRequest(query=QUERY, text=t) for t in TEXTS)
    streamed = rerank.RerankStream(pairs)
    assert [r.index for r in streamed.ranks] == [r["index"] for r in ranked]
    assert np.allclose([r.score for r in streamed.ranks], [r["score"] for r in ranked])


def test_tokenize_and_decode_answer_as_their_routes(server, channel):
    stub = pb_grpc.TokenizeStub(channel)
    pieces = post(server, "/tokenize", {"inputs": TEXTS}).json()
    got = stub.Tokenize(pb.EncodeRequest(inputs=TEXTS[1], add_special_tokens=True))
    as_json = [
        {
            "id": t.id,
            "text": t.text,
            "special": t.special,
            "start": t.start if t.HasField("start") else None,
            "stop": t.stop if t.HasField("stop") else None,
        }
        for t in got.tokens
    ]
    assert as_json == pieces[1]
    streamed = list(
        stub.TokenizeStream(
            iter(pb.EncodeRequest(inputs=t, add_special_tokens=True) for t in TEXTS)
        )
    )
    assert [[t.id for t in r.tokens] for r in streamed] == [[t["id"] for t in p] for p in pieces]
    ids = [t["id"] for t in pieces[0]]
    text = post(server, "/decode", {"ids": ids}).json()
    assert stub.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=True)).text == text[0]
    streamed = list(stub.DecodeStream(iter([pb.DecodeRequest(ids=ids, skip_special_tokens=True)])))
    assert [r.text for r in streamed] == text


def test_errors_carry_the_json_routes_messages_and_teis_codes(server, channel):
    embed = pb_grpc.EmbedStub(channel)

    def refused(call, request, **kwargs):
        with pytest.raises(grpc.RpcError) as failed:
            call(request, **kwargs)
        return failed.value

    blank = refused(embed.Embed, pb.EmbedRequest(inputs=" "))
    assert blank.code() == grpc.StatusCode.INVALID_ARGUMENT
    blank_error = post(server, "/embed", {"inputs": " "}).json()["error"]
    assert blank.details() == blank_error
    long = "word " * 400
    over = refused(embed.Embed, pb.EmbedRequest(inputs=long))
    json_over = post(server, "/embed", {"inputs": long, "truncate": False})
    assert json_over.status_code == 413 and over.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert over.details() == json_over.json()["error"]
    assert embed.Embed(pb.EmbedRequest(inputs=long, truncate=True)).embeddings
    nobody = refused(embed.Embed, pb.EmbedRequest(inputs="a"), metadata=[("model", "nope")])
    assert nobody.code() == grpc.StatusCode.NOT_FOUND
    # A stream stops at its first refused message, with that message's code, wherever that
    # message stands: the refusal races the answers before it (ended from the wrong task, its
    # status never reached the client, which waited forever: hence the deadline here).
    fine, blank = pb.EmbedRequest(inputs="fine"), pb.EmbedRequest(inputs=" ")
    for messages in ([fine, blank], [blank, fine], [fine, fine, blank, fine]) * 4:
        with pytest.raises(grpc.RpcError) as stopped:
            list(embed.EmbedStream(iter(messages), timeout=20))
        assert stopped.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stopped.value.details() == blank_error
    tokenize = pb_grpc.TokenizeStub(channel).TokenizeStream
    with pytest.raises(grpc.RpcError) as stopped:
        list(tokenize(iter([pb.EncodeRequest(inputs="fine"), pb.EncodeRequest()]), timeout=20))
    assert stopped.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_message_past_the_body_limit_is_refused_by_grpc_itself(checkpoints, tmp_path):
    from bertserve.export.bundle import build_bundle

    build_bundle(checkpoints["BertForPreTraining"], ["embed"], tmp_path / "b" / "embedder")
    with (
        live_server(bundles=tmp_path / "b", grpc_port=free_port(), max_body_bytes=4096) as live,
        grpc.insecure_channel(f"127.0.0.1:{live.state.grpc_port}") as channel,
        pytest.raises(grpc.RpcError) as failed,
    ):
        pb_grpc.EmbedStub(channel).Embed(pb.EmbedRequest(inputs="a " * 4096))
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_documented_grpc_snippet_runs(server):
    """docs/api.md's tei.v1 block, against this server's gRPC port."""
    import contextlib
    import io
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()
    section = text.split("## gRPC: text-embeddings-inference's tei.v1", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    block = block.replace("localhost:8001", f"127.0.0.1:{server.state.grpc_port}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "docs/api.md", "exec"), {})
    width = server.state.models["embedder"].spec.architecture.hidden_size
    first, second = printed.getvalue().splitlines()
    assert first.split()[0] == str(width) and int(first.split()[1]) > 0
    assert second == str([width, width])
