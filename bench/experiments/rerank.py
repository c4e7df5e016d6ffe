"""Rerank throughput and latency: bertserve's /rerank against the CrossEncoder peer (FastAPI
around sentence-transformers' CrossEncoder on the same checkpoint, bench/peers/cross_encoder.py),
same bodies, alternating which goes first each round, at each level of connections.

    bertserve bench rerank --bundle bundles/rerank-minilm --data ../shared/data/squad-v1.1 \
        --levels 1,8 --rounds 2 --report docs/reports/rerank-bench.md

A body is one SQuAD v1.1 dev question with 20 paragraphs of its article (about 150 tokens
each), `truncate` on: what a RAG pipeline sends after retrieval.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import time
from pathlib import Path

from bench.loadgen import closed_loop
from bench.run import commit
from bench.servers import OURS, only_bundles, serve

PEER = "cross-encoder"
SETTLE_S = 15  # longer than the peer takes for the requests a run leaves behind


def write_bodies(squad: Path, out: Path, count: int = 200, documents: int = 20) -> Path:
    data = json.loads((squad / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    rng = random.Random(0)
    lines: list[str] = []
    articles = [a for a in data if len(a["paragraphs"]) >= documents]
    while len(lines) < count:
        article = rng.choice(articles)
        paragraphs = [p["context"] for p in article["paragraphs"]]
        question = rng.choice(rng.choice(article["paragraphs"])["qas"])["question"]
        texts = rng.sample(paragraphs, documents)
        lines.append(json.dumps({"query": question, "texts": texts, "truncate": True}))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/rerank-minilm"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-v1.1"))
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-rerank"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    bodies = write_bodies(args.data, args.work / "rerank.jsonl")
    first = bodies.read_text().splitlines()[0].encode()
    only = only_bundles(args.bundle.parent, [args.bundle.name], args.work / "bundles")
    levels = [int(x) for x in args.levels.split(",")]
    runs: dict[str, dict[int, list[dict]]] = {OURS: {}, PEER: {}}
    for round_ in range(args.rounds):
        order = [OURS, PEER] if round_ % 2 == 0 else [PEER, OURS]
        for name in order:
            with serve(
                name,
                only,
                only / args.bundle.name,
                args.port,
                first,
                args.work / f"{name}.log",
                ready_path="/rerank",
            ) as server:
                url = f"{server.base}/rerank"
                # Warm with one connection, and let each level's leftovers finish before the next:
                # the peer's thread pool keeps computing requests whose client has gone.
                closed_loop(url, bodies, 1, 3)
                for level in levels:
                    time.sleep(SETTLE_S)
                    load = closed_loop(url, bodies, level, args.seconds)
                    runs[name].setdefault(level, []).append(load.to_dict())
                    print(
                        json.dumps(
                            {
                                "round": round_,
                                "server": name,
                                "level": level,
                                "req_s": load.throughput,
                                "p50_ms": load.p50_ms,
                                "statuses": load.statuses,
                            }
                        )
                    )
    rows = []
    for level in levels:
        ours, peer = runs[OURS][level], runs[PEER][level]
        best = {n: max(r["throughput"] for r in runs[n][level]) for n in (OURS, PEER)}
        p50 = {n: min(r["p50_ms"] for r in runs[n][level]) for n in (OURS, PEER)}
        ours_s = " / ".join(f"{r['throughput']:.1f}" for r in ours)
        peer_s = " / ".join(f"{r['throughput']:.1f}" for r in peer)
        rows.append(
            f"| {level} | {ours_s} | {peer_s} | {best[OURS] / best[PEER]:.2f}x | "
            f"{p50[OURS]:.0f} / {p50[PEER]:.0f} ms |"
        )
    statuses = {
        n: sorted({s for lv in runs[n].values() for r in lv for s in r["statuses"]}) for n in runs
    }
    text = "\n".join(
        [
            "# Rerank: bertserve against a CrossEncoder server",
            "",
            f"Measured on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at {commit()}, "
            f"{platform.machine()} with {os.cpu_count()} cores, with `bertserve bench rerank "
            f"--bundle {args.bundle} --levels {args.levels} --rounds {args.rounds} --seconds "
            f"{args.seconds:g}`. A request: one SQuAD dev question and 20 paragraphs of its "
            "article. The peer: FastAPI around sentence-transformers' CrossEncoder on the "
            "checkpoint the bundle was exported from (bench/peers/cross_encoder.py), one "
            "`predict` a request.",
            "",
            "| connections | bertserve req/s (rounds) | peer req/s (rounds) | best / best | "
            "p50 best, bertserve / peer |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Statuses seen: bertserve {statuses[OURS]}, peer {statuses[PEER]}.",
            "",
        ]
    )
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
