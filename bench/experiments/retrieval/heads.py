"""Several heads from one pass: one /encode request for dense + sparse vectors against the two
calls it replaces (/embed and /embed_sparse of the same texts), on one bundle of both heads over
one encoder, in one server, same minute (the order alternating each round), at each level of
connections, for questions (one a request) and passages (32 SQuAD dev paragraphs a request).

    bertserve checkpoint bundles/splade-minilm --out runs/splade-minilm-read
    bertserve export --checkpoint runs/splade-minilm-read --task embed,sparse \
        --out runs/splade-minilm-heads --max-seq-len 256 \
        --precision fp16-weights-int8-embeddings --eval-data ../shared/data/sst2/dev.tsv
    bertserve bench heads --bundle runs/splade-minilm-heads --levels 1,8 --rounds 2 \
        --report docs/reports/heads.md

Passages run at `--passage-levels` (default 1,2) for `--passage-seconds` (default 30): a
32-paragraph request takes seconds on two cores, and at 8 connections the bulk lane refuses
what it could not finish by the deadline (429), which is admission, not the heads' cost.

The two separate calls' time is each route's own at that level, added (1 / req/s of /embed +
1 / req/s of /embed_sparse: a client that makes them one after the other); the one-pass
request's is 1 / its req/s. /embed on this bundle computes no sparse head (it runs only for
calls that ask), so the pair pays the encoder twice and the head once, /encode the encoder
once and the head once.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from bench.experiments.retrieval.side_by_side import (
    Runs,
    add_load_arguments,
    alternate,
    report,
)
from bench.servers import OURS, linked_bundles, serve
from bertserve.runtime.bundle import load_bundle_spec

ROUTES = ("/embed", "/embed_sparse", "/encode")
KINDS = ["question", "passages"]


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
    extra = {"/embed": {}, "/embed_sparse": {}, "/encode": {"return_sparse": True}}
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind, items in texts.items():
        for route in ROUTES:
            bodies = [{"inputs": t, "truncate": True} | extra[route] for t in items]
            out[(kind, route)] = work / f"{kind}-{route.strip('/')}.jsonl"
            out[(kind, route)].write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    return out


def levels(kind: str, args: argparse.Namespace) -> list[int]:
    return [int(x) for x in (args.passage_levels if kind == "passages" else args.levels).split(",")]


def table(runs: Runs, args: argparse.Namespace) -> list[str]:
    """The Markdown table by the best round of each route: req/s of each, the sparse head's
    cost (/embed_sparse against /embed), and the one pass against the two calls."""
    lines = [
        "| body | connections | /embed req/s | /embed_sparse req/s | /encode (both) req/s | "
        "/embed_sparse / /embed | one pass / two calls (time) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        for level in levels(kind, args):
            best = {r: max(x["throughput"] for x in runs[(kind, r, level)]) for r in ROUTES}
            two = 1 / best["/embed"] + 1 / best["/embed_sparse"]
            lines.append(
                f"| {kind} | {level} | {best['/embed']:.1f} | {best['/embed_sparse']:.1f} | "
                f"{best['/encode']:.1f} | {best['/embed_sparse'] / best['/embed']:.2f}x | "
                f"{(1 / best['/encode']) / two:.2f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("runs/splade-minilm-heads"))
    parser.add_argument("--passage-levels", default="1,2")
    parser.add_argument("--passage-seconds", type=float, default=30)
    add_load_arguments(parser, port=8196, work="runs/bench-heads")
    args = parser.parse_args()
    spec = load_bundle_spec(args.bundle)
    if "sparse_embeddings" not in spec.heads:
        raise SystemExit(
            f"{args.bundle}: not a bundle of dense and sparse heads (--task embed,sparse)"
        )
    bodies = write_bodies(args.data, args.work)
    bundles = linked_bundles([args.bundle], args.work / "bundles")
    models = {route: spec.name for route in ROUTES}
    first = json.dumps({"inputs": "warm up", "return_sparse": True}).encode()
    with serve(
        OURS,
        bundles,
        bundles / args.bundle.name,
        args.port,
        first,
        args.work / "server.log",
        ready_path="/encode",
    ) as server:
        runs: Runs = {}
        for kind in KINDS:
            own = argparse.Namespace(**vars(args))
            if kind == "passages":
                own.levels, own.seconds = args.passage_levels, args.passage_seconds
            runs |= alternate(server, models, lambda k, route: bodies[(k, route)], [kind], own)
    command = (
        f"bertserve bench heads --bundle {args.bundle} --passage-levels {args.passage_levels} "
        f"--passage-seconds {args.passage_seconds:g}"
    )
    report(
        "Several heads from one pass: /encode against /embed + /embed_sparse",
        command,
        args,
        f"one server holding `{spec.name}` ({spec.precision}, dense and sparse heads over one "
        "encoder), the routes alternating first each round, best of the rounds. question: one "
        "SQuAD dev question a request; passages: 32 dev paragraphs a request (cut at the "
        "bundle's length). The two calls' time is the sum of each route's own at that level.",
        table(runs, args),
        runs,
    )


if __name__ == "__main__":
    main()
