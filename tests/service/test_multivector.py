"""Multi-vector (ColBERT) embeddings over real HTTP: PyLate 1.6 `ColBERT` directories (random
projections over a tiny BERT, four framings: PyLate's defaults with "[Q] "/"[D] " added to the
vocabulary, the vocabulary's own markers with attended expansion, queries without expansion or
marker, two Dense layers with a residual), saved by PyLate in its own virtualenv
(tests/pylate/job.py), exported by `build_bundle`, answer /v1/multi-vector equal to
`ColBERT.encode(is_query=...)` to 1e-5, vector for vector; /rerank and /v1/rerank on them score
by MaxSim of those vectors; the bad requests get 4xx that say what to do."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import transformers

from bertserve.export.bundle import SAMPLE_TEXTS, build_bundle, verify
from tests.helpers.checkpoints import TINY_SHAPE, hf_checkpoint, write_vocab
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get("BERTSERVE_PYLATE_PYTHON", ROOT / ".venv-pylate" / "bin" / "python"))
JOB = ROOT / "tests" / "pylate" / "job.py"
CASES = ["default", "unused-attend", "plain-queries", "two-dense"]
TEXTS = [
    "the film was good",
    "who was the first king of france ?",
    "paris",
    "a dull movie , a bad year ; (really) !",
    "the dog and the fox were born in london , a city on a river . " * 3,  # past 24 tokens
]


def pylate_python() -> Path:
    if not PYTHON.exists():
        message = f"no PyLate virtualenv at {PYTHON}: run `make pylate`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return PYTHON


def run_job(*args: str) -> None:
    done = subprocess.run(
        [str(pylate_python()), str(JOB), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def colberts(tmp_path_factory):
    """(root of the PyLate directories, PyLate's vectors of TEXTS for each)."""
    base = tmp_path_factory.mktemp("base") / "bert"
    config = transformers.BertConfig(**TINY_SHAPE, max_position_embeddings=128)
    transformers.BertModel(config).eval().save_pretrained(base)
    write_vocab(base / "vocab.txt")
    transformers.BertTokenizerFast(vocab_file=str(base / "vocab.txt")).save_pretrained(base)
    root = tmp_path_factory.mktemp("colberts")
    texts = root / "texts.json"
    texts.write_text(json.dumps(TEXTS))
    run_job(str(base), str(root), str(texts))
    return root, json.loads((root / "expected.json").read_text())


@pytest.fixture(scope="module")
def server(colberts, tmp_path_factory):
    root, _ = colberts
    bundles = tmp_path_factory.mktemp("multivector-bundles")
    for name in CASES:
        build_bundle(root / name, ["multivector"], bundles / name)
    cross = hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "cls", "BertForSequenceClassification")
    build_bundle(cross, ["classify"], bundles / "tiny-classify")
    with live_server(bundles=bundles, max_wait_ms=5, max_response_bytes=200_000) as live:
        yield live


def vectors(server, name: str, side: str, texts: list[str] | str) -> list[np.ndarray]:
    with server.client() as c:
        got = c.post("/v1/multi-vector", json={"input": texts, "model": name, "input_type": side})
    assert got.status_code == 200, got.text[:300]
    body = got.json()
    assert body["object"] == "list" and body["model"] == name
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [np.asarray(d["embeddings"], dtype=np.float32) for d in body["data"]]


@pytest.mark.parametrize("side", ["query", "document"])
@pytest.mark.parametrize("name", CASES)
def test_multi_vector_equals_pylate(server, colberts, name, side):
    expected = [np.asarray(v, dtype=np.float32) for v in colberts[1][name][side]]
    got = vectors(server, name, side, TEXTS)
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours.shape == theirs.shape, (i, ours.shape, theirs.shape)  # the same tokens kept
        assert np.abs(ours - theirs).max() <= 1e-5, i
    one = vectors(server, name, side, TEXTS[1])  # a bare input: one item all the same
    assert len(one) == 1 and np.abs(one[0] - expected[1]).max() <= 1e-5


def test_queries_are_expanded_and_documents_lose_their_punctuation(server, colberts):
    expected = colberts[1]["default"]
    assert {len(v) for v in expected["query"]} == {32}  # every query: 32 positions
    got = vectors(server, "default", "document", ["a , b", "a b"])
    assert len(got[0]) == len(got[1])  # the comma is skipped, not embedded


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    return float((query @ document.T).max(axis=1).sum())


@pytest.mark.parametrize("name", ["default", "two-dense"])
def test_rerank_scores_by_maxsim(server, colberts, name):
    expected = colberts[1][name]
    query = np.asarray(expected["query"][1])
    documents = [np.asarray(d) for d in expected["document"]]
    scores = [maxsim(query, d) for d in documents]
    with server.client() as c:
        tei = c.post(
            "/rerank", params={"model": name}, json={"query": TEXTS[1], "texts": TEXTS}
        ).json()
        cohere = c.post(
            "/v1/rerank",
            json={"query": TEXTS[1], "documents": TEXTS, "model": name, "top_n": 2},
        ).json()
    assert [r["index"] for r in tei] == list(np.argsort(-np.asarray(scores), kind="stable"))
    for r in tei:
        assert r["score"] == pytest.approx(scores[r["index"]], abs=1e-4)
    assert [r["index"] for r in cohere["results"]] == [r["index"] for r in tei[:2]]
    assert cohere["results"][0]["relevance_score"] == pytest.approx(tei[0]["score"], abs=1e-6)


def test_a_model_without_the_head_is_a_404_naming_those_with_it(server):
    with server.client() as c:
        got = c.post("/v1/multi-vector", params={"model": "tiny-classify"}, json={"input": "paris"})
    assert got.status_code == 404
    assert "has no multivector head" in got.text and "default" in got.text


def test_an_answer_past_the_limit_is_refused_before_the_work(server):
    batches = server.state.metrics.batch_rows

    def runs() -> float:
        return sum(
            s.value for m in batches.collect() for s in m.samples if s.name.endswith("_count")
        )

    before = runs()
    with server.client() as c:
        got = c.post(
            "/v1/multi-vector",
            json={"input": [TEXTS[4]] * 40, "model": "default", "input_type": "document"},
        )
    assert got.status_code == 413
    assert "BERTSERVE_MAX_RESPONSE_BYTES" in got.text and "200,000" in got.text
    assert runs() == before  # no model call was made for it


def test_bad_options_are_422s_that_say_what_to_send(server):
    with server.client() as c:
        width = c.post(
            "/v1/multi-vector", json={"input": "paris", "model": "default", "dimensions": 4}
        )
        long = c.post(
            "/v1/multi-vector",
            json={"input": TEXTS[4], "model": "unused-attend", "truncate": False},
        )
        kind = c.post(
            "/v1/multi-vector",
            json={"input": "paris", "model": "default", "embedding_type": "binary"},
        )
    assert width.status_code == 422 and "16 components" in width.text
    assert long.status_code == 422 and "document length (24)" in long.text
    assert kind.status_code == 422


def test_the_document_length_counts_every_position_as_the_refusal_says(server):
    """[CLS], the marker, the text and [SEP] fill the 24 positions: 21 words fit, 22 are
    refused in the same count (25 against 24), not one that leaves the marker out."""
    with server.client() as c:
        fits, over = (
            c.post(
                "/v1/multi-vector",
                json={"input": " ".join(["the"] * n), "model": "unused-attend", "truncate": False},
            )
            for n in (21, 22)
        )
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["data"][0]["embeddings"]) == 24
    assert over.status_code == 422
    assert "an input of 25 tokens" in over.text and "document length (24)" in over.text


def test_our_trainers_checkpoint_is_what_pylate_loads(tmp_path):
    """model/training/colbert.py saves as PyLate does: PyLate's encode of it is the service's
    answer for the bundle exported from it."""
    import torch

    from bertserve.model.checkpoint import load_model
    from bertserve.model.tokenizer import BertTokenizer
    from bertserve.model.training.colbert import ColbertModel, ColbertRecipe, save_colbert, spec_for

    base = hf_checkpoint(tmp_path / "base", "BertForSequenceClassification")
    tok = BertTokenizer.load(base)
    recipe = ColbertRecipe(name="tiny", dim=8, query_length=16, document_length=24)
    torch.manual_seed(0)
    model = ColbertModel(load_model(base, "BertModel"), recipe.dim)
    save_colbert(model, tok, base, spec_for(tok, recipe), tmp_path / "ours")
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(TEXTS))
    run_job("--encode", str(tmp_path / "ours"), str(texts), str(tmp_path / "theirs.json"))
    theirs = json.loads((tmp_path / "theirs.json").read_text())
    build_bundle(tmp_path / "ours", ["multivector"], tmp_path / "bundles" / "ours")
    # verify, its checkpoint at hand, runs torch (with the projection) against the graph again
    report = verify(tmp_path / "bundles" / "ours")
    assert "parity_checked" not in report and report["parity"]["max_abs_diff"] <= 1e-4
    assert report["parity"]["compared"] > len(SAMPLE_TEXTS)  # one row a real token
    with live_server(bundles=tmp_path / "bundles", max_wait_ms=5) as live:
        for side in ("query", "document"):
            got = vectors(live, "ours", side, TEXTS)
            for ours, ref in zip(got, theirs[side], strict=True):
                assert ours.shape == np.asarray(ref).shape
                assert np.abs(ours - np.asarray(ref)).max() <= 1e-5
