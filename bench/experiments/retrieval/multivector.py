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
import json
import random
from pathlib import Path

from bench.experiments.retrieval.side_by_side import (
    add_load_arguments,
    alternate,
    ratio_table,
    report,
)
from bench.servers import OURS, linked_bundles, serve
from bertserve.runtime.bundle import load_bundle_spec

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
    add_load_arguments(parser, port=8194, work="runs/bench-multivector")
    args = parser.parse_args()
    bodies = write_bodies(args.data, args.work)
    bundles = linked_bundles([args.multivector, args.dense], args.work / "bundles")
    models = {
        "/embed": load_bundle_spec(args.dense).name,
        "/v1/multi-vector": load_bundle_spec(args.multivector).name,
    }
    first = json.dumps({"input": "warm up", "model": models["/v1/multi-vector"]}).encode()
    kinds = ["question", "passages"]
    with serve(
        OURS,
        bundles,
        bundles / args.multivector.name,
        args.port,
        first,
        args.work / "server.log",
        ready_path="/v1/multi-vector",
    ) as server:
        runs = alternate(server, models, lambda kind, route: bodies[(kind, route)], kinds, args)
    command = f"bertserve bench multivector --multivector {args.multivector} --dense {args.dense}"
    report(
        "Multi-vector embeddings: /v1/multi-vector against /embed on the same encoder",
        command,
        args,
        "one server holding both bundles, the routes alternating first each round, best of the "
        "rounds. question: one SQuAD dev question a request (/v1/multi-vector: as a query, 32 "
        "positions); passages: 32 dev paragraphs a request (as documents; both cut at 192 "
        "tokens).",
        ratio_table(runs, kinds, args, "/embed", "/v1/multi-vector", "multi"),
        runs,
    )


if __name__ == "__main__":
    main()
