"""Multi-vector embeddings' cost: /v1/multi-vector against /embed on the same encoder, in one
server, same minute (the order alternating each round), at each level of connections, for
questions (one a request, as queries: 32 positions with the [MASK] expansion) and passages (32
SQuAD dev paragraphs a request, as documents, as an indexer sends them).

    bertserve bench multivector --multivector bundles/colbert-minilm \
        --dense runs/colbert-minilm-dense --levels 1,8 --rounds 2 \
        --report docs/reports/multivector.md

`--dense`: the same checkpoint exported with `--task embed --max-seq-len 192` at the
bundle's precision (`--precision fp16-weights-int8-embeddings --eval-data ...`; mean pooling
of its encoder, the document length), so the routes differ by what they compute and write:
/embed one pooled vector a text; /v1/multi-vector the 384 -> 128 projection at every position
and a vector a kept token as JSON (about 150 a paragraph).
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
from bench.servers import OURS, linked_bundles, serve
from bertserve.runtime.bundle import load_bundle_spec

SETTLE_S = 3
ROUTES = ("/embed", "/v1/multi-vector")


def write_bodies(squad: Path, work: Path, count: int = 200) -> dict[tuple[str, str], Path]:
    """(kind, route) -> a file of bodies: the same texts in each route's schema."""
    data = json.loads((squad / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p["context"] for a in data for p in a["paragraphs"]]
    questions = [q["question"] for a in data for p in a["paragraphs"] for q in p["qas"]]
    rng = random.Random(0)
    texts = {
        "question": [rng.choice(questions) for _ in range(count)],
        "passages": [rng.sample(paragraphs, 32) for _ in range(count // 4)],
    }
    side = {"question": "query", "passages": "document"}
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind, items in texts.items():
        for route in ROUTES:
            bodies = [
                {"inputs": t, "truncate": True}
                if route == "/embed"
                else {"input": t, "input_type": side[kind]}
                for t in items
            ]
            out[(kind, route)] = work / f"{kind}-{route.strip('/').replace('/', '-')}.jsonl"
            out[(kind, route)].write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--multivector", type=Path, default=Path("bundles/colbert-minilm"))
    parser.add_argument("--dense", type=Path, default=Path("runs/colbert-minilm-dense"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-v1.1"))
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8194)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-multivector"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    bodies = write_bodies(args.data, args.work)
    bundles = linked_bundles([args.multivector, args.dense], args.work / "bundles")
    names = {
        "/v1/multi-vector": load_bundle_spec(args.multivector).name,
        "/embed": load_bundle_spec(args.dense).name,
    }
    first = json.dumps({"input": "warm up", "model": names["/v1/multi-vector"]}).encode()
    levels = [int(x) for x in args.levels.split(",")]
    kinds = ("question", "passages")
    runs: dict[tuple[str, str, int], list[dict]] = {}
    with serve(
        OURS,
        bundles,
        bundles / args.multivector.name,
        args.port,
        first,
        args.work / "server.log",
        ready_path="/v1/multi-vector",
    ) as server:
        for round_ in range(args.rounds):
            order = list(ROUTES) if round_ % 2 == 0 else list(ROUTES)[::-1]
            for kind in kinds:
                for level in levels:
                    for route in order:
                        url = f"{server.base}{route}?model={names[route]}"
                        path = bodies[(kind, route)]
                        closed_loop(url, path, 1, 2)  # warm this route and shape
                        time.sleep(SETTLE_S)
                        load = closed_loop(url, path, level, args.seconds)
                        if set(load.statuses) != {"200"}:
                            raise SystemExit(f"{route} answered {load.statuses}: see the log")
                        runs.setdefault((kind, route, level), []).append(load.to_dict())
                        line = {"round": round_, "kind": kind, "route": route, "level": level}
                        print(json.dumps(line | {"req_s": load.throughput, "p50_ms": load.p50_ms}))
    rows = []
    for kind in kinds:
        for level in levels:
            best = {r: max(x["throughput"] for x in runs[(kind, r, level)]) for r in ROUTES}
            p50 = {r: min(x["p50_ms"] for x in runs[(kind, r, level)]) for r in ROUTES}
            multi, dense = best["/v1/multi-vector"], best["/embed"]
            rows.append(
                f"| {kind} | {level} | {dense:.1f} | {multi:.1f} | {multi / dense:.2f}x | "
                f"{p50['/embed']:.1f} / {p50['/v1/multi-vector']:.1f} ms |"
            )
    statuses = sorted({s for v in runs.values() for x in v for s in x["statuses"]})
    text = "\n".join(
        [
            "# Multi-vector embeddings: /v1/multi-vector against /embed on the same encoder",
            "",
            f"Measured on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at {commit()}, "
            f"{platform.machine()} ({platform.processor() or 'cpu'}) with {os.cpu_count()} "
            f"cores, with `bertserve bench multivector --multivector {args.multivector} --dense "
            f"{args.dense} --levels {args.levels} --rounds {args.rounds} --seconds "
            f"{args.seconds:g}`: one server holding both bundles, the routes alternating first "
            "each round, best of the rounds. question: one SQuAD dev question a request "
            "(/v1/multi-vector: as a query, 32 positions); passages: 32 dev paragraphs a request "
            "(as documents; both cut at 192 tokens).",
            "",
            "| body | connections | /embed req/s | /v1/multi-vector req/s | multi / dense | "
            "p50, dense / multi |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Statuses seen: {statuses}.",
            "",
        ]
    )
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
