"""Retrieval evaluated as a user runs it: a running service's /embed, /embed_sparse and /rerank
over HTTP, on SQuAD v1.1 dev with the whole dev corpus as the documents (2,067 paragraphs) and
every question as a query (gold: the question's own paragraph).

    bertserve evaluate --task retrieval --url http://127.0.0.1:8000 --data DATA/squad-v1.1 \
        [--dense minilm-embed] [--sparse splade-minilm] [--rerank msmarco-minilm-l12-rerank] \
        [--multivector colbert-minilm] [--quantized]

Measured: recall@1, recall@10 and MRR@10 of
- BM25 (`bm25s`, English stop words; the baseline),
- dense: the cosine of /embed vectors,
- quantised (with `--quantized`, the dense vectors from one /v2/embed pass in float, int8 and
  ubinary): the int8 vectors' dot product, the binary ones' Hamming distance, and the binary
  ranking's first 100 rescored by the float question against the int8 paragraphs
  (sentence-transformers' binary-index, int8-rescoring recipe),
- sparse: the dot product of /embed_sparse vectors (questions as "query", paragraphs as
  "document"),
- multi-vector (with `--multivector`): MaxSim of /v1/multi-vector vectors (questions as
  "query", paragraphs as "document") over the whole corpus,
- hybrid: reciprocal-rank fusion (RRF, k = 60: the sum of 1 / (60 + rank) over the rankings'
  first 100) of dense and sparse, of dense and BM25 for comparison, and (with `--multivector`)
  of dense, sparse and multi-vector,
- reranked: the hybrid's first 20 reranked by /rerank (a cross-encoder), on the first
  `rerank_questions` questions of a fixed draw (20 pairs a question cost minutes a thousand).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

RRF_K = 60
FUSED_DEPTH = 100  # each ranking's first 100 enter the fusion
RERANK_DEPTH = 20


def post(url: str, path: str, body: dict[str, Any], model: str | None, tries: int = 6) -> Any:
    """The answer to one request; a 429 or 503 (the service's overload refusals) is sent
    again after its Retry-After, as a client under load does."""
    query = f"?model={model}" if model else ""
    request = urllib.request.Request(
        f"{url.rstrip('/')}{path}{query}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code not in (429, 503) or attempt == tries - 1:
                raise
            time.sleep(float(exc.headers.get("Retry-After") or 1) * (attempt + 1))
    raise AssertionError("unreachable")


def in_batches(
    texts: list[str], call: Callable[[list[str]], list[Any]], desc: str, size: int = 32
) -> list[Any]:
    """`call` on `texts` in requests of `size`, four at a time (the service batches them)."""
    batches = [texts[i : i + size] for i in range(0, len(texts), size)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(tqdm(pool.map(call, batches), total=len(batches), desc=desc, leave=False))
    return [a for batch in answers for a in batch]


def read_dev(data_dir: Path) -> tuple[list[str], list[str], np.ndarray]:
    """Every dev paragraph, every dev question and its paragraph's index."""
    data = json.loads((data_dir / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs: list[str] = []
    questions: list[str] = []
    gold: list[int] = []
    for article in data:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                questions.append(qa["question"])
                gold.append(len(paragraphs))
            paragraphs.append(paragraph["context"])
    return paragraphs, questions, np.asarray(gold)


def rankings(scores: np.ndarray, depth: int = FUSED_DEPTH) -> np.ndarray:
    """Each row's `depth` best columns, best first (ties in column order)."""
    depth = min(depth, scores.shape[1])
    top = np.argpartition(-scores, depth - 1, axis=1)[:, :depth]
    order = np.argsort(-np.take_along_axis(scores, top, 1), axis=1, kind="stable")
    return np.take_along_axis(top, order, 1)


def metrics(ranked: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """Recall@1, recall@10 and MRR@10 of `gold` in each row's ranking."""
    hits = ranked[:, :10] == gold[:, None]
    first = np.where(hits.any(1), hits.argmax(1) + 1, 0)
    return {
        "recall1": round(float((first == 1).mean()), 4),
        "recall10": round(float((first > 0).mean()), 4),
        "mrr10": round(float(np.where(first > 0, 1.0 / np.maximum(first, 1), 0.0).mean()), 4),
    }


def fuse(*ranked: np.ndarray, k: int = RRF_K) -> np.ndarray:
    """Reciprocal-rank fusion of rankings of the same queries: a document's score is the sum
    of 1 / (k + its rank) over the rankings it appears in."""
    out = []
    for rows in zip(*ranked, strict=True):
        score: dict[int, float] = {}
        for row in rows:
            for rank, doc in enumerate(row.tolist(), 1):
                score[doc] = score.get(doc, 0.0) + 1.0 / (k + rank)
        out.append(sorted(score, key=lambda d: (-score[d], d))[:FUSED_DEPTH])
    width = min(len(r) for r in out)
    return np.asarray([r[:width] for r in out])


def bm25_scores(paragraphs: list[str], questions: list[str]) -> np.ndarray:
    import bm25s

    retriever = bm25s.BM25()
    tokens = bm25s.tokenize(paragraphs, stopwords="en", show_progress=False)
    retriever.index(tokens, show_progress=False)
    found, values = retriever.retrieve(
        bm25s.tokenize(questions, stopwords="en", show_progress=False),
        k=min(FUSED_DEPTH, len(paragraphs)),
        show_progress=False,
    )
    scores = np.full((len(questions), len(paragraphs)), -np.inf, dtype=np.float32)
    np.put_along_axis(scores, found, values, 1)
    return scores


def sparse_matrix(answers: list[list[dict[str, Any]]], width: int) -> Any:
    from scipy.sparse import csr_matrix

    indptr = np.cumsum([0, *(len(a) for a in answers)])
    indices = [e["index"] for a in answers for e in a]
    values = [e["value"] for a in answers for e in a]
    return csr_matrix((values, indices, indptr), shape=(len(answers), width), dtype=np.float32)


def maxsim_scores(
    queries: list[np.ndarray], documents: list[np.ndarray], chunk: int = 8
) -> np.ndarray:
    """(Q, P) MaxSim of every query against every document: the documents' vectors in one
    matrix, each query token's best dot product within each document (`reduceat` over the
    documents' offsets), summed over the query's tokens."""
    flat = np.concatenate(documents).astype(np.float32)
    starts = np.cumsum([0, *(len(d) for d in documents[:-1])])
    out = np.empty((len(queries), len(documents)), dtype=np.float32)
    for i in tqdm(range(0, len(queries), chunk), desc="maxsim", leave=False):
        block = queries[i : i + chunk]
        stacked = np.concatenate(block).astype(np.float32)  # (tokens, D)
        best = np.maximum.reduceat(stacked @ flat.T, starts, axis=1)  # (tokens, P)
        cuts = np.cumsum([0, *(len(q) for q in block)])
        out[i : i + len(block)] = np.add.reduceat(best, cuts[:-1], axis=0)
    return out


def quantized_rankings(
    queries: np.ndarray,
    query_int8: np.ndarray,
    query_bits: np.ndarray,
    doc_int8: np.ndarray,
    doc_bits: np.ndarray,
) -> dict[str, np.ndarray]:
    """int8 dot products, binary Hamming distances, and the binary ranking's first
    FUSED_DEPTH rescored by the float queries against the int8 documents."""
    q8, d8 = query_int8.astype(np.int32), doc_int8.astype(np.int32)
    popcount = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1)
    q, d = query_bits.astype(np.uint8), doc_bits.astype(np.uint8)
    hamming = np.stack([popcount[np.bitwise_xor(row, d)].sum(1) for row in q])
    binary = rankings(-hamming.astype(np.float32))
    rescored = np.stack(
        [
            row[np.argsort(-(doc_int8[row].astype(np.float32) @ query), kind="stable")]
            for row, query in zip(binary[:, :FUSED_DEPTH], queries, strict=True)
        ]
    )
    return {
        "dense_int8": rankings((q8 @ d8.T).astype(np.float32)),
        "dense_binary": binary,
        "dense_binary_int8_rescored": rescored,
    }


def evaluate_retrieval(
    url: str,
    data_dir: Path,
    dense: str | None = None,
    sparse: str | None = None,
    reranker: str | None = None,
    questions: int | None = None,
    rerank_questions: int = 500,
    multivector: str | None = None,
    quantized: bool = False,
) -> dict[str, Any]:
    """The table of the module's docstring, through the service at `url`. `dense`, `sparse`
    and `reranker`: model names (None: the service's default for that task); `multivector`:
    a ColBERT bundle's name (None: not measured); `questions`: the first N of a fixed draw
    (None: all)."""
    paragraphs, texts, gold = read_dev(data_dir)
    order = np.random.default_rng(0).permutation(len(texts))[:questions]
    texts, gold = [texts[i] for i in order], gold[order]
    result: dict[str, Any] = {
        "data": f"SQuAD v1.1 dev: {len(texts)} questions, {len(paragraphs)} paragraphs",
        "fusion": f"reciprocal rank (k = {RRF_K}) over each ranking's first {FUSED_DEPTH}",
        "models": {"dense": dense, "sparse": sparse, "rerank": reranker}
        | ({"multivector": multivector} if multivector else {}),
    }
    ranked: dict[str, np.ndarray] = {"bm25": rankings(bm25_scores(paragraphs, texts))}

    def embed(batch: list[str]) -> list[Any]:
        return post(url, "/embed", {"inputs": batch, "truncate": True}, dense)

    if quantized:
        kinds = ["float", "int8", "ubinary"]

        def embed(batch: list[str]) -> list[Any]:
            answer = post(url, "/v2/embed", {"texts": batch, "embedding_types": kinds}, dense)
            types = answer["embeddings"]
            return list(zip(*(types[k] for k in kinds), strict=True))

        doc_sets = in_batches(paragraphs, embed, "dense paragraphs")
        query_sets = in_batches(texts, embed, "dense questions")
        docs, doc_int8, doc_bits = (np.asarray(x) for x in zip(*doc_sets, strict=True))
        queries, query_int8, query_bits = (np.asarray(x) for x in zip(*query_sets, strict=True))
        docs, queries = docs.astype(np.float32), queries.astype(np.float32)
        ranked.update(quantized_rankings(queries, query_int8, query_bits, doc_int8, doc_bits))
    else:
        docs = np.asarray(in_batches(paragraphs, embed, "dense paragraphs"), dtype=np.float32)
        queries = np.asarray(in_batches(texts, embed, "dense questions"), dtype=np.float32)
    ranked["dense"] = rankings(queries @ docs.T)

    def splade(side: str) -> Callable[[list[str]], list[Any]]:
        def call(batch: list[str]) -> list[Any]:
            body = {"inputs": batch, "truncate": True, "input_type": side}
            return post(url, "/embed_sparse", body, sparse)

        return call

    doc_answers = in_batches(paragraphs, splade("document"), "sparse paragraphs")
    query_answers = in_batches(texts, splade("query"), "sparse questions")
    width = 1 + max(e["index"] for a in doc_answers + query_answers for e in a)
    sparse_scores = (
        sparse_matrix(query_answers, width) @ sparse_matrix(doc_answers, width).T
    ).toarray()
    ranked["sparse"] = rankings(sparse_scores)
    result["sparse_nonzero"] = {
        "question": round(float(np.mean([len(a) for a in query_answers])), 1),
        "paragraph": round(float(np.mean([len(a) for a in doc_answers])), 1),
    }
    if multivector:

        def colbert(side: str) -> Callable[[list[str]], list[Any]]:
            def call(batch: list[str]) -> list[Any]:
                body = {"input": batch, "input_type": side, "model": multivector}
                data = post(url, "/v1/multi-vector", body, None)["data"]
                return [np.asarray(d["embeddings"], dtype=np.float32) for d in data]

            return call

        doc_vectors = in_batches(paragraphs, colbert("document"), "multi-vector paragraphs", 8)
        query_vectors = in_batches(texts, colbert("query"), "multi-vector questions")
        ranked["multivector"] = rankings(maxsim_scores(query_vectors, doc_vectors))
        result["multivector_tokens"] = {
            "question": round(float(np.mean([len(v) for v in query_vectors])), 1),
            "paragraph": round(float(np.mean([len(v) for v in doc_vectors])), 1),
        }
    ranked["hybrid_dense_sparse"] = fuse(ranked["dense"], ranked["sparse"])
    ranked["hybrid_dense_bm25"] = fuse(ranked["dense"], ranked["bm25"])
    if multivector:
        ranked["hybrid_dense_sparse_multivector"] = fuse(
            ranked["dense"], ranked["sparse"], ranked["multivector"]
        )
    result |= {name: metrics(r, gold) for name, r in ranked.items()}
    few = min(rerank_questions, len(texts))
    hybrid = ranked["hybrid_dense_sparse"][:few, :RERANK_DEPTH]
    reordered = []
    for q, row in tqdm(list(zip(texts[:few], hybrid, strict=True)), desc="rerank", leave=False):
        body = {"query": q, "texts": [paragraphs[i] for i in row], "truncate": True}
        answer = post(url, "/rerank", body, reranker)
        reordered.append([row[a["index"]] for a in answer])
    result["hybrid_dense_sparse_reranked"] = metrics(np.asarray(reordered), gold[:few]) | {
        "questions": few,
        "reranked": f"the hybrid's first {RERANK_DEPTH}",
    }
    result["hybrid_dense_sparse_on_reranked_questions"] = metrics(hybrid, gold[:few])
    return result
