"""Rerank over real HTTP: a tiny cross-encoder (a one-output BertForSequenceClassification, as
sentence-transformers' CrossEncoder saves one) exported with the `rerank` task answers /rerank
(text-embeddings-inference's schema) and /v1/rerank, /v2/rerank (Cohere's, through the real
`cohere` client) with CrossEncoder.predict's own scores."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.checkpoints import cross_encoder as tiny_cross_encoder
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
QUERY = "who was the first king of france ?"
DOCS = [
    "the king of france was born in paris",
    "a dull movie , a bad year",
    "the dog and the fox",
    "paris is a city on a river",
    "london",
]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def server(cross_encoder, tmp_path_factory):
    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("rerank-bundles")
    spec = build_bundle(cross_encoder, ["rerank"], root / "tiny-reranker")
    assert spec.tasks == ["rerank"] and spec.outputs == ["logits"]
    with live_server(bundles=root, max_rerank_documents=8) as live:
        yield live


@pytest.fixture(scope="module")
def expected(cross_encoder) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, d) for d in DOCS])


def test_tei_rerank_equals_cross_encoder_predict(server, expected):
    with server.client() as c:
        ranked = c.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
        raw = c.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    assert ranked.status_code == 200
    items = ranked.json()
    assert [i["index"] for i in items] == np.argsort(-expected, kind="stable").tolist()
    assert np.allclose([i["score"] for i in items], np.sort(expected)[::-1], atol=1e-4)
    assert all(i["text"] == DOCS[i["index"]] for i in items)
    logits = np.log(expected / (1 - expected))
    assert np.allclose(
        [r["score"] for r in sorted(raw, key=lambda r: r["index"])], logits, atol=1e-3
    )


def test_cohere_clients_v1_and_v2(server, expected):
    cohere = pytest.importorskip("cohere")
    order = np.argsort(-expected, kind="stable").tolist()
    v1 = cohere.Client(api_key="unused", base_url=server.url)
    got = v1.rerank(
        model="rerank-v3.5", query=QUERY, documents=DOCS, top_n=3, return_documents=True
    )
    assert [r.index for r in got.results] == order[:3]
    assert np.allclose([r.relevance_score for r in got.results], expected[order[:3]], atol=1e-4)
    assert [r.document.text for r in got.results] == [DOCS[i] for i in order[:3]]
    assert got.model == "tiny-reranker"
    v2 = cohere.ClientV2(api_key="unused", base_url=server.url)
    second = v2.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS)
    assert [r.index for r in second.results] == order


def test_documents_as_objects_and_the_bounds(server, expected):
    with server.client() as c:
        objects = c.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 1},
        ).json()
        too_many = c.post("/rerank", json={"query": QUERY, "texts": ["x"] * 9})
        long = "the dog and the fox " * 40
        refused = c.post("/rerank", json={"query": QUERY, "texts": [long]})
        cut = c.post("/rerank", json={"query": QUERY, "texts": [long], "truncate": True})
        cohere_cut = c.post("/v1/rerank", json={"query": QUERY, "documents": [long]})
        empty = c.post("/rerank", json={"query": QUERY, "texts": []})
    assert [r["index"] for r in objects["results"]] == [int(np.argmax(expected))]
    assert objects["usage"]["total_tokens"] > len(DOCS) * 5
    assert too_many.status_code == 413
    assert too_many.json()["error"] == (
        "9 documents in one request; the limit is 8 (BERTSERVE_MAX_RERANK_DOCUMENTS)"
    )
    assert refused.status_code == 413 and "truncat" in refused.json()["error"]
    assert cut.status_code == 200 and cohere_cut.status_code == 200
    assert empty.status_code == 422


def test_a_classifier_with_several_labels_is_no_reranker(tmp_path):
    from bertserve.export.bundle import build_bundle
    from tests.helpers.checkpoints import hf_checkpoint

    checkpoint = hf_checkpoint(tmp_path / "sentiment", "BertForSequenceClassification")
    with pytest.raises(ValueError, match="needs a cross-encoder .* has 3 labels"):
        build_bundle(checkpoint, ["rerank"], tmp_path / "bundle")


def test_bad_input_names_the_field(server):
    with server.client() as c:
        no_query = c.post("/rerank", json={"query": " ", "texts": DOCS})
        no_docs = c.post("/v1/rerank", json={"query": QUERY, "documents": []})
        bad_top = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 0})
        bad_type = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": "2"})
    assert [r.status_code for r in (no_query, no_docs, bad_top, bad_type)] == [422] * 4
    assert "query" in no_query.json()["error"]
    # /v1/ answers OpenAI's error shape: {"error": {"message", "type", "param", "code"}}
    assert "documents" in no_docs.json()["error"]["message"]
    assert no_docs.json()["error"]["code"] == "invalid_input"
    assert "top_n" in bad_top.json()["error"]["message"]
    assert "top_n" in bad_type.json()["error"]["message"]


def test_requests_share_model_calls(server):
    """Concurrent rerank requests' pairs run in shared batches: fewer model calls than
    requests."""
    import asyncio

    import httpx

    def calls() -> float:
        with server.client() as c:
            text = c.get("/metrics").text
        prefix = 'bertserve_batch_rows_count{model="tiny-reranker"}'
        return float(next(ln for ln in text.splitlines() if ln.startswith(prefix)).split()[-1])

    before = calls()

    async def concurrent():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = {"query": QUERY, "texts": DOCS[:2]}
            return await asyncio.gather(*(c.post("/rerank", json=body) for _ in range(16)))

    responses = asyncio.run(concurrent())
    assert all(r.status_code == 200 for r in responses)
    assert len({r.text for r in responses}) == 1  # batched with others, the same answer
    assert calls() - before < 16


def test_the_fields_rerank_clients_send(server, expected):
    """litellm's `top_n` and haystack's `truncation_direction: "Left"` on /rerank; Cohere v1's
    rank_fields and max_chunks_per_doc, v2's max_tokens_per_doc and priority on /v1/rerank."""
    order = np.argsort(-expected, kind="stable").tolist()
    long = "the dog and the fox " * 40
    with server.client() as c:
        top = c.post("/rerank", json={"query": QUERY, "texts": DOCS, "top_n": 2}).json()
        left = c.post(
            "/rerank",
            json={
                "query": QUERY,
                "texts": [long],
                "truncate": True,
                "truncation_direction": "Left",
            },
        )
        fields = c.post(
            "/v1/rerank",
            json={
                "query": QUERY,
                "documents": [{"title": d, "id": i} for i, d in enumerate(DOCS)],
                "rank_fields": ["title"],
                "return_documents": True,
                "max_chunks_per_doc": 10,
            },
        ).json()
        as_text = c.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": [f"title: {d}" for d in DOCS]},
        ).json()
        cut = c.post(
            "/v2/rerank",
            json={"query": QUERY, "documents": [long], "max_tokens_per_doc": 5, "priority": 1},
        ).json()
        five = c.post("/v2/rerank", json={"query": QUERY, "documents": ["the dog and the fox"]})
        no_field = c.post(
            "/v1/rerank", json={"query": QUERY, "documents": [{"title": "x"}], "rank_fields": ["a"]}
        )
        written = c.post("/v1/rerank", json={"query": QUERY, "documents": ["title: x"]}).json()
        no_text = c.post("/v1/rerank", json={"query": QUERY, "documents": [{"text": None}]})
        big = {"text": DOCS[0], "n": 2**80}  # past 64 bits: returned as sent
        echoed = c.post(
            "/v1/rerank",
            json={
                "query": QUERY,
                "documents": [big],
                "rank_fields": ["n"],
                "return_documents": True,
            },
        )
    assert [r["index"] for r in top] == order[:2]
    assert left.status_code == 200
    assert [r["index"] for r in fields["results"]] == [r["index"] for r in as_text["results"]]
    assert np.allclose(
        [r["relevance_score"] for r in fields["results"]],
        [r["relevance_score"] for r in as_text["results"]],
    )
    best = fields["results"][0]
    assert best["document"] == {"title": DOCS[best["index"]], "id": best["index"]}
    assert cut["results"][0]["relevance_score"] == pytest.approx(
        five.json()["results"][0]["relevance_score"], abs=1e-6
    )
    # A document with none of the fields named ranks on all of its own.
    assert no_field.status_code == 200, no_field.text[:300]
    assert no_field.json()["results"][0]["relevance_score"] == pytest.approx(
        written["results"][0]["relevance_score"], abs=1e-6
    )
    # Without rank_fields an object document needs a text, and a null one is not a text.
    assert no_text.status_code == 422, no_text.text[:300]
    assert echoed.status_code == 200, echoed.text[:300]
    assert echoed.json()["results"][0]["document"] == big


def test_a_cross_encoders_saved_max_length_is_honoured(cross_encoder, tmp_path):
    """A CrossEncoder saved with `max_length` (tokenizer_config.json's model_max_length) cuts
    pairs there: exported with no flags, the bundle cuts them at the same length, so a long pair
    scores as `predict` scores it."""
    from sentence_transformers import CrossEncoder

    from bertserve.export.bundle import build_bundle

    CrossEncoder(str(cross_encoder), device="cpu", max_length=24).save(str(tmp_path / "ce"))
    spec = build_bundle(tmp_path / "ce", ["rerank"], tmp_path / "bundles" / "ce-24")
    assert spec.max_seq_len == 24
    docs = [" ".join(DOCS * 3), DOCS[0]]
    expected = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict([(QUERY, d) for d in docs])
    with live_server(bundles=tmp_path / "bundles") as live, live.client() as c:
        answer = c.post("/rerank", json={"query": QUERY, "texts": docs, "truncate": True})
    assert answer.status_code == 200
    scores = [r["score"] for r in sorted(answer.json(), key=lambda r: r["index"])]
    np.testing.assert_allclose(scores, expected, atol=1e-5)
