"""Long documents through HTTP: SQuAD v1.1 dev articles as documents (each article's paragraphs
joined by blank lines, 48 of them, up to about 17,500 tokens), its questions as queries.

    bertserve bench long-inputs --embed bundles/minilm-embed \
        --rerank bundles/msmarco-minilm-l12-rerank --report docs/reports/long-inputs.md

Retrieval top-1 (the question's own article ranks first of the 48) for each way of embedding a
document: cut to the window (`long_input: "truncate"`), one vector of its chunks
(`long_input: "chunk"`), and its best chunk from `/embed/chunks` (a document's score is its best
chunk's cosine) without and with late chunking. Then /rerank of each sampled question's
`--candidates` best articles by best chunk (`long_input: "chunk"`), against the best-chunk
figure on the same questions. Then throughput: the articles indexed through /embed/chunks (one
article a request) against the same chunks sent as texts to /embed in client batches of 32,
alternated A B B A in the same minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.run import commit
from bench.servers import OURS, only_bundles, serve


def post(url: str, body: dict[str, Any], timeout: float = 600) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def load_squad(path: Path) -> tuple[list[str], list[str], list[int]]:
    data = json.loads((path / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    articles = ["\n\n".join(p["context"] for p in a["paragraphs"]) for a in data]
    questions, gold = [], []
    for i, article in enumerate(data):
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                questions.append(qa["question"])
                gold.append(i)
    return articles, questions, gold


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def top1(scores: np.ndarray, gold: np.ndarray) -> float:
    return float((scores.argmax(1) == gold).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--embed", type=Path, default=Path("bundles/minilm-embed"))
    parser.add_argument("--rerank", type=Path, default=Path("bundles/msmarco-minilm-l12-rerank"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-v1.1"))
    parser.add_argument("--rerank-questions", type=int, default=100)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--port", type=int, default=8193)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-long-inputs"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    articles, questions, gold_list = load_squad(args.data)
    gold = np.asarray(gold_list)
    names = [args.embed.name, args.rerank.name]
    only = only_bundles(args.embed.parent, names, args.work / "bundles")
    ready = json.dumps({"inputs": "ready?"}).encode()
    results: dict[str, Any] = {}
    with serve(
        OURS,
        only,
        only / args.embed.name,
        args.port,
        ready,
        args.work / "server.log",
        ready_path="/embed",
    ) as server:
        base = server.base
        embed = f"{base}/embed?model={args.embed.name}"
        chunks_url = f"{base}/embed/chunks?model={args.embed.name}"
        q = np.concatenate(
            [
                np.asarray(post(embed, {"inputs": questions[i : i + 256]}))
                for i in range(0, len(questions), 256)
            ]
        )
        scores: dict[str, np.ndarray] = {}
        for mode in ("truncate", "chunk"):
            docs = np.asarray(
                [post(embed, {"inputs": [a], "long_input": mode})[0] for a in articles]
            )
            scores[mode] = q @ unit(docs).T
        chunked: dict[str, list[list[dict]]] = {}
        for late in (False, True):
            name = "late" if late else "chunks"
            chunked[name] = [
                post(chunks_url, {"inputs": [a], "late": late, "return_text": not late})[0]
                for a in articles
            ]
            best = np.full((len(questions), len(articles)), -np.inf)
            for j, doc in enumerate(chunked[name]):
                vectors = unit(np.asarray([c["embedding"] for c in doc]))
                best[:, j] = (q @ vectors.T).max(1)
            scores[name] = best
        for name, s in scores.items():
            results[f"top1_{name}"] = top1(s, gold)
        results["chunks"] = sum(len(d) for d in chunked["chunks"])
        results["pieces"] = sum(c["tokens"] for d in chunked["chunks"] for c in d)

        # Rerank: each sampled question's best candidates by best chunk, chunked on the server.
        rng = random.Random(0)
        sample = rng.sample(range(len(questions)), args.rerank_questions)
        rerank = f"{base}/rerank?model={args.rerank.name}"
        hits, embed_hits, started = 0, 0, time.perf_counter()
        for i in sample:
            candidates = np.argsort(-scores["chunks"][i], kind="stable")[: args.candidates]
            embed_hits += int(candidates[0] == gold[i])
            order = post(
                rerank,
                {
                    "query": questions[i],
                    "texts": [articles[j] for j in candidates],
                    "long_input": "chunk",
                },
            )
            hits += int(candidates[order[0]["index"]] == gold[i])
        results["rerank_top1"] = hits / len(sample)
        results["rerank_embed_top1"] = embed_hits / len(sample)
        results["rerank_s_per_question"] = (time.perf_counter() - started) / len(sample)

        # Throughput: the same chunks, A B B A.
        texts = [c["text"] for d in chunked["chunks"] for c in d]

        def through_chunks() -> float:
            t = time.perf_counter()
            for a in articles:
                post(chunks_url, {"inputs": [a]})
            return time.perf_counter() - t

        def through_batches() -> float:
            t = time.perf_counter()
            for k in range(0, len(texts), 32):
                post(embed, {"inputs": texts[k : k + 32]})
            return time.perf_counter() - t

        timings: dict[str, list[float]] = {"chunks": [], "batches": []}
        for name in ("chunks", "batches", "batches", "chunks"):
            timings[name].append(through_chunks() if name == "chunks" else through_batches())
        results["timings_s"] = timings
        results["ratio"] = sum(timings["batches"]) / sum(timings["chunks"])
    print(json.dumps(results, indent=1))
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    trunc = results["top1_truncate"]
    verdict = {
        "chunk": results["top1_chunk"] >= trunc + 0.08,
        "chunks": results["top1_chunks"] >= max(0.85, trunc + 0.15),
        "late": results["top1_late"] >= results["top1_chunks"],
        "rerank": results["rerank_top1"] >= results["rerank_embed_top1"],
        "throughput": results["ratio"] >= 0.9,
    }

    def mark(key: str) -> str:
        return "met" if verdict[key] else "**missed**"

    t = results["timings_s"]
    text = "\n".join(
        [
            "# Long documents: chunking, late chunking and best-chunk rerank",
            "",
            f"Measured on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at {commit()}, "
            f"{platform.machine()} with {os.cpu_count()} cores, with `bertserve bench "
            f"long-inputs --embed {args.embed} --rerank {args.rerank} --rerank-questions "
            f"{args.rerank_questions} --candidates {args.candidates}`, through HTTP. Documents: "
            f"the {len(articles)} SQuAD v1.1 dev articles, each its paragraphs joined by blank "
            f"lines; queries: its {len(questions):,} questions; a hit: the question's own "
            "article ranks first. /embed/chunks at its defaults made "
            f"{results['chunks']:,} chunks of {results['pieces']:,} pieces.",
            "",
            "| document as | top-1 | target | verdict |",
            "|---|---|---|---|",
            f"| truncated to the window (`long_input: truncate`) | {trunc:.3f} | baseline | |",
            f"| one vector of its chunks (`long_input: chunk`) | {results['top1_chunk']:.3f} | "
            f">= truncation + 0.08 | {mark('chunk')} |",
            f"| its best chunk (`/embed/chunks`, defaults) | {results['top1_chunks']:.3f} | "
            f">= 0.85 and truncation + 0.15 | {mark('chunks')} |",
            f"| its best chunk, late chunking (`late: true`) | {results['top1_late']:.3f} | "
            f">= without | {mark('late')} |",
            "",
            f"Rerank of each of {args.rerank_questions} sampled questions' "
            f"{args.candidates} best articles by best chunk, `long_input: chunk` (an article "
            "scored by its best chunk): top-1 "
            f"**{results['rerank_top1']:.3f}** against {results['rerank_embed_top1']:.3f} for "
            f"the best chunk's order on the same questions ({mark('rerank')}; "
            f"{results['rerank_s_per_question']:.1f} s a question).",
            "",
            f"Indexing the {len(articles)} articles: through /embed/chunks, one article a "
            f"request, {t['chunks'][0]:.1f} / {t['chunks'][1]:.1f} s; the same chunks as texts "
            f"to /embed in client batches of 32, {t['batches'][0]:.1f} / "
            f"{t['batches'][1]:.1f} s (order A B B A). /embed/chunks at "
            f"**{results['ratio']:.2f}x** the client batches' rate (target >= 0.9x: "
            f"{mark('throughput')}).",
            "",
        ]
    )
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
