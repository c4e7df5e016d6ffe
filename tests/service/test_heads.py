"""Several heads over one encoder (`bertserve export --task embed,sparse`: bundle.json "heads"),
over real HTTP: /embed equals sentence-transformers' mean-pooled encoder, /embed_sparse
equals `SparseEncoder.encode_document`, /encode answers both from one pass; the sparse head
runs only for the calls that ask for it, and a batch of /embed and /embed_sparse rows runs the
encoder once."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

from bertserve.export.bundle import build_bundle, convert_bundle, verify
from bertserve.export.graph import ExportError
from bertserve.export.recover import RecoverError, checkpoint_from_bundle
from bertserve.runtime.bundle import BundleError, check_model_file, load_bundle_spec
from bertserve.runtime.engine import Engine, EngineOptions
from tests.conftest import shared_data
from tests.helpers.checkpoints import hf_checkpoint
from tests.helpers.server import live_server
from tests.helpers.sparse import sparse_encoder

pytestmark = pytest.mark.slow

TEXTS = [
    "the film was good",
    "who was the first king of france ?",
    "paris",
    "the dog and the fox were born in london , a city on a river . " * 2,
]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return sparse_encoder(tmp_path_factory.mktemp("encoder"), "bert")


@pytest.fixture(scope="module")
def bundles(encoder, tmp_path_factory):
    root = tmp_path_factory.mktemp("head-bundles")
    build_bundle(encoder, ["embed", "sparse"], root / "both")
    # first by name: the default /embed bundle, with no sparse head
    dense = hf_checkpoint(root.parent / "dense-ckpt", "BertForQuestionAnswering")
    build_bundle(dense, ["embed"], root / "a-dense")
    build_bundle(encoder, ["sparse"], root / "sparse-only")
    return root


@pytest.fixture(scope="module")
def server(bundles):
    with live_server(bundles=bundles, max_wait_ms=5, max_response_bytes=1_000_000) as live:
        yield live


def dense_reference(encoder, texts: list[str]) -> np.ndarray:
    """The encoder's last hidden states mean-pooled and normalised, as sentence-transformers
    computes them (the MLM head left out)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(str(encoder))
    pooling = Pooling(transformer.get_embedding_dimension(), "mean")
    model = SentenceTransformer(modules=[transformer, pooling], device="cpu")
    return model.encode(texts, normalize_embeddings=True)


def sparse_reference(encoder, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(encoder), device="cpu")
    return model.encode_document(texts, convert_to_tensor=True).to_dense().numpy()


def as_dense(entries: list[list[dict]], width: int) -> np.ndarray:
    out = np.zeros((len(entries), width), dtype=np.float32)
    for i, vector in enumerate(entries):
        for e in vector:
            out[i, e["index"]] = e["value"]
    return out


def test_the_bundle_keeps_its_sparse_head_in_a_graph_of_its_own(bundles):
    spec = load_bundle_spec(bundles / "both")
    assert spec.tasks == ["embed", "sparse"]
    assert spec.graph_outputs == ["embeddings", "token_embeddings"]
    assert list(spec.heads) == ["sparse_embeddings"]
    assert spec.files == ["model.onnx", "model.sparse-head.onnx"]
    assert spec.export_parity["max_abs_diff"] <= 1e-4
    report = verify(bundles / "both")  # the checkpoint is at hand: parity checked again
    assert report["parity"]["max_abs_diff"] <= 1e-4


def test_each_route_equals_its_library_on_the_shared_encoder(server, encoder):
    dense = dense_reference(encoder, TEXTS)
    sparse = sparse_reference(encoder, TEXTS)
    with server.client() as c:
        got_dense = c.post("/embed", params={"model": "both"}, json={"inputs": TEXTS})
        got_sparse = c.post("/embed_sparse", params={"model": "both"}, json={"inputs": TEXTS})
        alone = c.post("/embed_sparse", params={"model": "sparse-only"}, json={"inputs": TEXTS})
    assert np.abs(np.asarray(got_dense.json()) - dense).max() <= 1e-5
    vectors = as_dense(got_sparse.json(), sparse.shape[1])
    assert np.abs(vectors - sparse).max() <= 1e-5 * sparse.max()
    assert ((vectors > 1e-4) == (sparse > 1e-4)).all()
    # the same head as a sparse bundle of one graph answers the same
    assert np.abs(as_dense(alone.json(), sparse.shape[1]) - vectors).max() <= 1e-5 * sparse.max()


def test_encode_answers_both_from_one_request(server, encoder):
    dense = dense_reference(encoder, TEXTS)
    with server.client() as c:
        both = c.post("/encode", json={"inputs": TEXTS, "return_sparse": True})
        sparse = c.post("/embed_sparse", params={"model": "both"}, json={"inputs": TEXTS})
        top = c.post(
            "/encode",
            json={"inputs": TEXTS[1], "return_dense": False, "return_sparse": True, "top_k": 3},
        )
        plain = c.post("/encode", params={"model": "a-dense"}, json={"inputs": TEXTS})
    assert both.status_code == 200, both.text[:300]
    body = both.json()
    assert body["model"] == "both"  # the default /embed bundle has no sparse head
    assert body["usage"]["prompt_tokens"] > len(TEXTS)
    assert np.abs(np.asarray(body["dense_vecs"]) - dense).max() <= 1e-5
    expected = [{str(e["index"]): e["value"] for e in v} for v in sparse.json()]
    assert body["lexical_weights"] == expected
    assert all(list(w) == sorted(w, key=int) for w in body["lexical_weights"])
    answer = top.json()  # one bare text: its object itself, as BGEM3FlagModel.encode answers
    assert answer["dense_vecs"] is None and answer["colbert_vecs"] is None
    kept = answer["lexical_weights"]
    assert len(kept) == 3
    assert sorted(kept.values()) == sorted(expected[1].values())[-3:]
    # dense only: any embedding bundle
    assert plain.status_code == 200 and plain.json()["lexical_weights"] is None


def test_a_request_for_a_head_the_bundle_lacks_names_those_with_it(server):
    with server.client() as c:
        named = c.post(
            "/encode", params={"model": "a-dense"}, json={"inputs": "x", "return_sparse": True}
        )
        neither = c.post("/encode", json={"inputs": "x", "return_dense": False})
        colbert = c.post("/encode", json={"inputs": "x", "return_colbert_vecs": True})
        wide = c.post(
            "/encode",
            json={"inputs": "x", "return_dense": False, "return_sparse": True, "dimensions": 999},
        )
    assert named.status_code == 404
    assert "'both'" in named.json()["error"] and "embed and sparse" in named.json()["error"]
    assert neither.status_code == 422 and "return_sparse" in neither.json()["error"]
    assert colbert.status_code == 422 and "/v1/multi-vector" in colbert.json()["error"]
    assert wide.status_code == 422 and "dimensions 999" in wide.json()["error"]


def test_an_answer_past_the_limit_is_refused_before_the_work(bundles):
    # 20 texts of up to 99 weights (the tiny vocabulary): 51,640 bytes besides the vectors'
    # 10,880
    body = {"inputs": ["x"] * 20, "return_sparse": True, "top_k": 1000}
    with live_server(bundles=bundles, max_response_bytes=40_000) as live, live.client() as c:
        refused = c.post("/encode", params={"model": "both"}, json=body)
        dense = c.post("/encode", params={"model": "both"}, json={**body, "return_sparse": False})
        rows = c.get("/metrics").text
    assert refused.status_code == 413, refused.text[:300]
    assert "40,000" in refused.json()["error"] and "top_k" in refused.json()["error"]
    assert dense.status_code == 200, dense.text[:300]  # the vectors alone fit
    assert batches(rows)[1] == 20  # the refused request ran no rows


def batches(text: str) -> tuple[float, float]:
    """Model `both`'s calls and their rows, from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == "bertserve_batch_rows":
            got = {s.name: s.value for s in family.samples if s.labels.get("model") == "both"}
            return got.get("bertserve_batch_rows_count", 0), got.get("bertserve_batch_rows_sum", 0)
    return 0, 0


def test_the_sparse_head_runs_only_when_asked(bundles):
    spec = load_bundle_spec(bundles / "both")
    engine = Engine(bundles / "both", spec, EngineOptions())
    ids = np.full((3, 7), 5, dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": ids * 0}
    ids[1, 4:] = spec.tokenizer.pad_id  # rows of their own, one padded
    ids[2] = np.arange(10, 17)
    mask = (ids != spec.tokenizer.pad_id).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": ids * 0}
    calls = []
    head = engine.heads["sparse_embeddings"][1]
    original = head.run

    def counted(*args, **kwargs):  # the real session, its calls counted
        calls.append(args[1]["token_embeddings"].shape)
        return original(*args, **kwargs)

    head.run = counted
    assert sorted(engine.run(feeds)) == ["embeddings"] and calls == []
    asked = engine.run(feeds, extra=("sparse_embeddings",))
    assert sorted(asked) == ["embeddings", "sparse_embeddings"] and len(calls) == 1
    assert asked["sparse_embeddings"].shape == (3, spec.tokenizer.vocab_size)
    # each row as a call of its own: the head's slices are the rows', in order
    for i in range(3):
        alone = {k: v[i : i + 1, : int(mask[i].sum())] for k, v in feeds.items()}
        single = engine.run(alone, extra=("sparse_embeddings",))["sparse_embeddings"][0]
        np.testing.assert_allclose(asked["sparse_embeddings"][i], single, atol=1e-5)
    # A vocabulary-wide head's calls are bounded in tokens; the encoder's call stays whole.
    engine.head_tokens["sparse_embeddings"] = 14  # two rows of 7 a call
    calls.clear()
    chunked = engine.run(feeds, extra=("sparse_embeddings",))
    assert [shape[0] for shape in calls] == [2, 1]
    np.testing.assert_allclose(chunked["sparse_embeddings"], asked["sparse_embeddings"], atol=1e-6)


@pytest.mark.parametrize("lone_threads", [1, 2])
def test_a_head_has_a_lone_session_where_the_model_graph_has_one(bundles, lone_threads):
    spec = load_bundle_spec(bundles / "both")
    engine = Engine(bundles / "both", spec, EngineOptions(threads=1, lone_threads=lone_threads))
    _, shared, lone = engine.heads["sparse_embeddings"]
    assert shared is not None and (lone is not None) == engine.runs_alone == (lone_threads > 1)
    ids = np.full((1, 5), 5, dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": ids * 0}
    used = []
    for label, session in (("shared", shared), ("lone", lone)):
        if session is not None:
            run = session.run
            session.run = lambda *a, _run=run, _label=label, **k: (
                used.append(_label) or _run(*a, **k)
            )
    together = engine.run(feeds, extra=("sparse_embeddings",))
    alone = engine.run(feeds, alone=True, extra=("sparse_embeddings",))
    assert used == (["shared", "lone"] if lone_threads > 1 else ["shared", "shared"])
    np.testing.assert_allclose(alone["sparse_embeddings"], together["sparse_embeddings"], atol=1e-6)


def test_a_mixed_batch_runs_the_encoder_once(bundles):
    """An /embed, an /embed_sparse and a dense-only /encode request arriving together share
    one batch: one call of the model graph (bertserve_batch_rows counts it), each answered as
    alone."""
    with live_server(
        bundles=bundles, max_wait_ms=400, max_queue_wait_ms=5_000, max_response_bytes=1_000_000
    ) as live:
        with live.client() as c:
            alone_dense = c.post("/embed", params={"model": "both"}, json={"inputs": TEXTS[0]})
            alone_sparse = c.post(
                "/embed_sparse", params={"model": "both"}, json={"inputs": TEXTS[1]}
            )
            alone_encode = np.asarray(
                c.post("/embed", params={"model": "both"}, json={"inputs": TEXTS[2]}).json()[0]
            )
            before = batches(c.get("/metrics").text)
        answers: dict[str, object] = {}

        def send(path: str, text: str) -> None:
            with live.client() as c:
                answers[path] = c.post(path, params={"model": "both"}, json={"inputs": text})

        threads = [
            threading.Thread(target=send, args=("/embed", TEXTS[0])),
            threading.Thread(target=send, args=("/embed_sparse", TEXTS[1])),
            threading.Thread(target=send, args=("/encode", TEXTS[2])),  # dense only
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with live.client() as c:
            after = batches(c.get("/metrics").text)
    assert answers["/encode"].status_code == 200, answers["/encode"].text[:300]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 3)  # one call of three rows
    encoded = answers["/encode"].json()
    assert encoded["lexical_weights"] is None
    assert np.abs(np.asarray(encoded["dense_vecs"]) - alone_encode).max() <= 1e-6
    mixed_dense = np.asarray(answers["/embed"].json())
    assert np.abs(mixed_dense - np.asarray(alone_dense.json())).max() <= 1e-6
    mixed = {e["index"]: e["value"] for e in answers["/embed_sparse"].json()[0]}
    single = {e["index"]: e["value"] for e in alone_sparse.json()[0]}
    assert mixed.keys() == single.keys()
    assert max(abs(mixed[k] - single[k]) for k in single) <= 1e-5


def test_a_changed_or_missing_head_file_is_a_bundle_error(bundles, tmp_path):
    copy = tmp_path / "both"
    shutil.copytree(bundles / "both", copy)
    head = copy / "model.sparse-head.onnx"
    head.write_bytes(head.read_bytes()[:-1] + b"\0")
    with pytest.raises(BundleError, match="sparse-head.onnx: sha256"):
        check_model_file(copy, load_bundle_spec(copy))
    head.unlink()
    with pytest.raises(BundleError, match="sparse-head.onnx: missing"):
        load_bundle_spec(copy)
    spec = json.loads((bundles / "both" / "bundle.json").read_text())
    spec["outputs"] = ["embeddings", "sparse_embeddings", "token_embeddings"]
    (copy / "bundle.json").write_text(json.dumps(spec))
    shutil.copy(bundles / "both" / "model.sparse-head.onnx", head)
    with pytest.raises(BundleError, match="come last|should be in outputs"):
        load_bundle_spec(copy)


def test_what_a_bundle_of_heads_refuses(encoder, bundles, tmp_path):
    with pytest.raises(ExportError, match="carries embed, sparse"):
        build_bundle(encoder, ["embed", "sparse", "fill-mask"], tmp_path / "x")
    plain = hf_checkpoint(tmp_path / "plain", "BertForQuestionAnswering")
    with pytest.raises(ExportError, match="no sparse head"):
        build_bundle(plain, ["embed", "sparse"], tmp_path / "y")
    with pytest.raises(ValueError, match="graphs of its own"):
        convert_bundle(bundles / "both", "int8", shared_data("sst2", "dev.tsv"))
    with pytest.raises(RecoverError, match="graphs of their own"):
        checkpoint_from_bundle(bundles / "both", tmp_path / "back")


def test_a_quantised_bundle_of_heads_converts_each_graph(encoder, tmp_path):
    spec = build_bundle(
        encoder,
        ["embed", "sparse"],
        tmp_path / "int8",
        precision="int8",
        eval_data=shared_data("sst2", "dev.tsv"),
        force=True,  # random weights: agreement is not what this checks
    )
    import onnx

    head = onnx.load(str(tmp_path / "int8" / spec.heads["sparse_embeddings"].file))
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in head.graph.node)
    assert spec.variant_accuracy["texts"] > 100  # both graphs measured on real text


@pytest.mark.parametrize("family", ["distilbert", "roberta", "xlm-roberta", "electra"])
def test_every_family_of_the_shared_encoder_equals_its_libraries(family, tmp_path):
    """The other families model/bert.py serves: their own inputs (no segments for DistilBERT
    and RoBERTa), position offsets and MLM heads through the head graph."""
    encoder = sparse_encoder(tmp_path / "encoder", family)
    build_bundle(encoder, ["embed", "sparse"], tmp_path / "bundles" / family)
    dense = dense_reference(encoder, TEXTS)
    sparse = sparse_reference(encoder, TEXTS)
    with (
        live_server(bundles=tmp_path / "bundles", max_response_bytes=10_000_000) as live,
        live.client() as c,
    ):
        body = c.post("/encode", json={"inputs": TEXTS, "return_sparse": True})
    assert body.status_code == 200, body.text[:300]
    answer = body.json()
    assert np.abs(np.asarray(answer["dense_vecs"]) - dense).max() <= 1e-5
    got = np.zeros_like(sparse)
    for i, weights in enumerate(answer["lexical_weights"]):
        for token, weight in weights.items():
            got[i, int(token)] = weight
    assert np.abs(got - sparse).max() <= 1e-5 * sparse.max()
    assert ((got > 1e-4) == (sparse > 1e-4)).all()
