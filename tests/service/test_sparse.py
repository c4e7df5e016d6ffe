"""Sparse (SPLADE) embeddings over real HTTP: SparseEncoder directories saved by
sentence-transformers 5.7 (random weights, every family whose MLM head is served, both poolings
and activations, and an inference-free model whose queries skip the encoder), exported by
`build_bundle`, answer /embed_sparse equal to `SparseEncoder.encode_query` / `encode_document`:
within 1e-5 of the largest weight, the same entries above 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from bertserve.export.bundle import build_bundle
from bertserve.runtime.bundle import BundleError, load_bundle_spec
from bertserve.runtime.tasks.common import TaskContext
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
FAMILIES = ["bert", "distilbert", "roberta", "xlm-roberta", "electra", "modernbert", "deberta-v2"]
# (family, inference_free, pooling, activation, prompts)
CASES = {f"{f}-splade": (f, False, "max", "relu", None) for f in FAMILIES}
CASES |= {
    "bert-free": ("bert", True, "max", "relu", None),
    "bert-sum-log1p": ("bert", False, "sum", "log1p_relu", None),
    "bert-prompted": ("bert", True, "max", "relu", {"query": "query : ", "document": "a "}),
}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse-encoders")
    return {name: sparse_encoder(root / name, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def bundles(encoders, tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse-bundles")
    for name, directory in encoders.items():
        build_bundle(directory, ["sparse"], root / name)  # at the length the directory saves
    cross = hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "cls", "BertForSequenceClassification")
    build_bundle(cross, ["classify"], root / "tiny-classify")
    return root


@pytest.fixture(scope="module")
def server(bundles):
    # an answer limit a tiny vocabulary's vectors can pass
    with live_server(bundles=bundles, max_wait_ms=5, max_response_bytes=1_000_000) as live:
        yield live


def dense(answer: list[list[dict]], width: int) -> np.ndarray:
    out = np.zeros((len(answer), width), dtype=np.float32)
    for i, entries in enumerate(answer):
        indices = [e["index"] for e in entries]
        assert indices == sorted(indices), "TEI's entries come in index order"
        for e in entries:
            out[i, e["index"]] = e["value"]
    return out


def reference(directory, side: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(directory), device="cpu")
    encode = model.encode_query if side == "query" else model.encode_document
    return encode(texts, convert_to_tensor=True).to_dense().numpy()


@pytest.mark.parametrize("side", ["query", "document"])
@pytest.mark.parametrize("name", list(CASES))
def test_embed_sparse_equals_the_sparse_encoder(server, encoders, name, side):
    expected = reference(encoders[name], side, TEXTS)
    with server.client() as c:
        batched = c.post(
            "/embed_sparse", params={"model": name}, json={"inputs": TEXTS, "input_type": side}
        )
        single = c.post(
            "/embed_sparse", params={"model": name}, json={"inputs": TEXTS[1], "input_type": side}
        )
    assert batched.status_code == 200, batched.text[:300]
    got = dense(batched.json(), expected.shape[1])
    assert np.abs(got - expected).max() <= 1e-5 * expected.max()
    assert ((got > 1e-4) == (expected > 1e-4)).all()
    assert (got[expected == 0] == 0).all()  # no entry the library leaves out
    assert len(single.json()) == 1  # a list, also for one input (TEI)
    assert np.abs(dense(single.json(), expected.shape[1])[0] - expected[1]).max() <= (
        1e-5 * expected.max()
    )


def test_an_inference_free_query_costs_no_model_call(server):
    batcher = server.state.models["bert-free"].batcher
    runs = server.state.metrics.batch_rows
    before = sum(s.value for m in runs.collect() for s in m.samples if s.name.endswith("_count"))
    with server.client() as c:
        query = c.post(
            "/embed_sparse",
            params={"model": "bert-free"},
            json={"inputs": TEXTS, "input_type": "query"},
        )
    after = sum(s.value for m in runs.collect() for s in m.samples if s.name.endswith("_count"))
    assert query.status_code == 200 and after == before and batcher is not None
    weights = {e["index"] for e in query.json()[2]}
    with server.client() as c:
        tokens = c.post("/tokenize", params={"model": "bert-free"}, json={"inputs": TEXTS[2]})
    ids = {t["id"] for t in tokens.json()[0] if not t["special"]}
    assert weights == ids  # each of the text's own pieces, and nothing else


def test_top_k_min_weight_and_tokens(server, encoders):
    expected = reference(encoders["bert-splade"], "document", TEXTS[:1])[0]
    with server.client() as c:
        top = c.post(
            "/embed_sparse",
            params={"model": "bert-splade"},
            json={"inputs": TEXTS[0], "top_k": 5, "return_tokens": True},
        ).json()[0]
        ordered = np.sort(expected[expected > 0])
        half = len(ordered) // 2  # between two weights: the cut is not a float32 tie
        least = float(ordered[half - 1] + ordered[half]) / 2
        kept = c.post(
            "/embed_sparse",
            params={"model": "bert-splade"},
            json={"inputs": TEXTS[0], "min_weight": least},
        ).json()[0]
        tokens = c.post("/decode", params={"model": "bert-splade"}, json={"ids": [top[0]["index"]]})
    assert sorted(e["index"] for e in top) == sorted(np.argsort(-expected)[:5].tolist())
    assert all(isinstance(e["token"], str) for e in top)
    assert top[0]["token"].replace("##", "") in tokens.text.replace(" ", "")
    assert {e["index"] for e in kept} == set(np.flatnonzero(expected >= least).tolist())


def test_a_model_without_the_head_is_a_404_naming_those_with_it(server):
    with server.client() as c:
        wrong = c.post("/embed_sparse", params={"model": "tiny-classify"}, json={"inputs": "a"})
        sparse_on_classify = c.post(
            "/classify", params={"model": "bert-free"}, json={"inputs": "a"}
        )
    assert wrong.status_code == 404
    assert "has no sparse head" in wrong.json()["error"] and "bert-free" in wrong.json()["error"]
    assert sparse_on_classify.status_code == 404
    assert "tiny-classify" in sparse_on_classify.json()["error"]


def test_an_answer_past_the_limit_is_refused_before_the_work(server):
    limit = server.state.settings.max_response_bytes
    batcher = server.state.models["bert-splade"].batcher
    enqueue = batcher.enqueue
    calls: list[int] = []
    batcher.enqueue = lambda rows, bulk=False, *rest: (
        calls.append(len(rows)) or enqueue(rows, bulk, *rest)
    )
    try:
        with server.client() as c:
            big = c.post(
                "/embed_sparse",
                params={"model": "bert-splade"},
                json={"inputs": ["paris"] * 2000, "top_k": 50},
            )
    finally:
        batcher.enqueue = enqueue
    assert limit < 2000 * 50 * 44
    assert big.status_code == 413, big.text[:300]
    assert "BERTSERVE_MAX_RESPONSE_BYTES" in big.json()["error"] and "top_k" in big.json()["error"]
    assert calls == []


def test_long_inputs_chunk_into_the_max_of_their_chunks(server):
    from bertserve.runtime.tasks.embed import text_rows

    long = "the film was good and the dog was bad . " * 20  # past the 128-token window
    ctx = server.state.models["bert-splade"].ctx
    rows, _ = text_rows(ctx, [long], None, "chunk")
    chunks = [ctx.tokenizer.decode(r.input_ids.tolist()) for r in rows]
    assert len(chunks) > 1
    with server.client() as c:
        refused = c.post("/embed_sparse", params={"model": "bert-splade"}, json={"inputs": long})
        chunked = c.post(
            "/embed_sparse",
            params={"model": "bert-splade"},
            json={"inputs": long, "long_input": "chunk"},
        )
        each = c.post("/embed_sparse", params={"model": "bert-splade"}, json={"inputs": chunks})
        static = c.post(
            "/embed_sparse",
            params={"model": "bert-free"},
            json={"inputs": long, "input_type": "query", "long_input": "chunk"},
        )
    assert refused.status_code == 413 and "long_input" in refused.json()["error"]
    assert chunked.status_code == 200 and each.status_code == 200
    expected = dense(each.json(), 99).max(0)
    assert np.abs(dense(chunked.json(), 99)[0] - expected).max() <= 1e-5 * expected.max()
    assert static.status_code == 422 and "truncate" in static.json()["error"]


def test_a_changed_static_file_is_a_bundle_error(bundles, tmp_path):
    import shutil

    bundle = tmp_path / "copy"
    shutil.copytree(bundles / "bert-free", bundle)
    spec = load_bundle_spec(bundle)
    assert spec.sparse is not None and spec.sparse.static_side == "query"
    weights = np.load(bundle / spec.sparse.static_file)
    np.save(bundle / spec.sparse.static_file, weights * 2)
    with pytest.raises(BundleError, match="sha256"):
        TaskContext.load(bundle, spec, 10_000)


def test_a_cpu_call_of_a_sparse_model_holds_its_logits_to_a_bound(server):
    """The MLM logits of a call are 4 bytes a vocabulary entry a token: a sparse model's calls
    on a CPU hold at most 64 MiB of them (at least one full row), and its batcher keeps to that;
    other models and other providers keep max_batch_tokens."""
    from bertserve.service.models import call_tokens

    spec = server.state.models["bert-splade"].spec

    def shaped(vocab: int, length: int):
        tokenizer = spec.tokenizer.model_copy(update={"vocab_size": vocab})
        return spec.model_copy(update={"tokenizer": tokenizer, "max_seq_len": length})

    # MiniLM's 30,522 pieces: 549 tokens of 122 kB of logits (two rows of 256); a 250k-piece
    # vocabulary (XLM-R's) gets one full row, whatever that takes
    assert call_tokens(shaped(30_522, 256), "CPUExecutionProvider") == 549
    assert call_tokens(shaped(250_002, 256), "CPUExecutionProvider") == 256
    assert call_tokens(spec, "CUDAExecutionProvider") is None
    assert call_tokens(server.state.models["tiny-classify"].spec, "CPUExecutionProvider") is None
    cap = call_tokens(spec, "CPUExecutionProvider")
    batcher = server.state.models["bert-splade"].batcher
    assert batcher.max_tokens == min(server.state.settings.max_batch_tokens, cap)


def test_a_sparse_model_runs_without_the_cpu_arena(server):
    """Its logits would otherwise stay in the arena after the warm-up (850 MiB a worker for
    MiniLM); other models keep the service's setting."""
    assert server.state.models["bert-splade"].engine.cpu_arena == "no-arena"
    assert server.state.models["tiny-classify"].engine.cpu_arena == "shrink"
