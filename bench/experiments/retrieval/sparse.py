"""Sparse embeddings' cost: /embed_sparse against /embed on the same encoder, in one server,
same minute (the order alternating each round), at each level of connections, for questions
(one a request) and passages (32 SQuAD dev paragraphs a request, as an indexer sends them).

    bertserve bench sparse --sparse bundles/splade-minilm --dense runs/splade-minilm-dense \
        --levels 1,8 --rounds 2 --report docs/reports/sparse.md

`--dense`: the same checkpoint exported with `--task embed` (mean pooling), so the two routes
differ only by the head: /embed pools the last hidden states; /embed_sparse runs the MLM head
(384 -> 30,522) at every position, pools it and writes the non-zero weights as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.experiments.retrieval.side_by_side import (
    add_load_arguments,
    alternate,
    ratio_table,
    report,
)
from bench.servers import OURS, linked_bundles, serve
from bertserve.runtime.bundle import load_bundle_spec

# The graph alone, as the service runs a sparse model (no CPU arena: runtime.engine), at the
# default max_batch_tokens, a quarter of it, and the cap a CPU call of a sparse model is held
# to (service.models.call_tokens): full rows of 256 tokens.
CALL_SHAPES = ((32, 256), (8, 256), (2, 256))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_call_shape(bundle: Path, rows: int, length: int, calls: int = 6) -> dict[str, float]:
    """µs a token, and the memory a call takes: the highest resident size sampled every
    millisecond through the calls, over the loaded session's (run alone in a fresh process)."""
    import threading

    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    options.enable_cpu_mem_arena = False  # as runtime.engine serves a sparse model
    session = ort.InferenceSession(
        str(bundle / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )
    ids = np.random.default_rng(0).integers(1000, 29000, (rows, length)).astype(np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }
    names = ["sparse_embeddings"]
    session.run(names, feeds)  # the first call's own allocations (no arena: given back)
    loaded, peak, done = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], rss_mib())

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    for _ in range(calls):
        session.run(names, feeds)
    per_token = (time.perf_counter() - started) / calls / ids.size * 1e6
    done.set()
    sampler.join()
    call = max(0.0, peak[0] - loaded)
    return {"rows": rows, "length": length, "us_per_token": per_token, "call_mib": call}


def call_shapes(bundle: Path) -> list[dict[str, float]]:
    """Each of CALL_SHAPES in a process of its own, alternated twice; the faster of each."""
    found: dict[tuple[int, int], dict[str, float]] = {}
    for _ in range(2):
        for rows, length in CALL_SHAPES:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.experiments.retrieval.sparse",
                    "--call-shape",
                    str(bundle),
                    str(rows),
                    str(length),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            old = found.get((rows, length))
            if old is None or result["us_per_token"] < old["us_per_token"]:
                found[(rows, length)] = result
    return list(found.values())


def write_bodies(squad: Path, work: Path, count: int = 200) -> dict[str, Path]:
    """Question bodies (one a request) and passage bodies (32 paragraphs a request)."""
    data = json.loads((squad / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p["context"] for a in data for p in a["paragraphs"]]
    questions = [q["question"] for a in data for p in a["paragraphs"] for q in p["qas"]]
    rng = random.Random(0)
    kinds = {
        "question": [{"inputs": rng.choice(questions), "truncate": True} for _ in range(count)],
        "passages": [
            {"inputs": rng.sample(paragraphs, 32), "truncate": True} for _ in range(count // 4)
        ],
    }
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind, bodies in kinds.items():
        out[kind] = work / f"{kind}.jsonl"
        out[kind].write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sparse", type=Path, default=Path("bundles/splade-minilm"))
    parser.add_argument("--dense", type=Path, default=Path("runs/splade-minilm-dense"))
    add_load_arguments(parser, port=8193, work="runs/bench-sparse")
    parser.add_argument("--call-shape", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.call_shape:
        bundle, rows, length = args.call_shape
        print(json.dumps(one_call_shape(Path(bundle), int(rows), int(length))))
        return
    shapes = call_shapes(args.sparse)
    bodies = write_bodies(args.data, args.work)
    bundles = linked_bundles([args.sparse, args.dense], args.work / "bundles")
    # a model is served under its bundle's name
    models = {
        "/embed": load_bundle_spec(args.dense).name,
        "/embed_sparse": load_bundle_spec(args.sparse).name,
    }
    first = bodies["question"].read_text().splitlines()[0].encode()
    kinds = list(bodies)
    with serve(
        OURS,
        bundles,
        bundles / args.sparse.name,
        args.port,
        first,
        args.work / "server.log",
        ready_path="/embed_sparse",
    ) as server:
        runs = alternate(server, models, lambda kind, route: bodies[kind], kinds, args)
    shape_rows = [
        f"| {int(c['rows'])} x {int(c['length'])} = {int(c['rows'] * c['length']):,} | "
        f"{c['us_per_token']:.0f} | {c['call_mib']:,.0f} |"
        for c in shapes
    ]
    command = f"bertserve bench sparse --sparse {args.sparse} --dense {args.dense}"
    report(
        "Sparse embeddings: /embed_sparse against /embed on the same encoder",
        command,
        args,
        "one server holding both bundles, the routes alternating first each round, best of the "
        "rounds. question: one SQuAD dev question a request; passages: 32 dev paragraphs a "
        "request (`truncate` on).",
        ratio_table(runs, kinds, args, "/embed", "/embed_sparse", "sparse"),
        runs,
        [
            "The sparse graph alone (ONNX Runtime, every core, no CPU arena, as the service "
            "runs a sparse model), one call of each shape in a fresh process, alternated "
            "twice, the faster kept: the default max_batch_tokens (8,192), a quarter of it, and "
            "the cap a CPU call of a sparse model is held to (549 tokens here, two rows of "
            "256: `service.models.call_tokens`).",
            "",
            "| call (rows x tokens) | µs a token | memory a call (sampled peak), MiB |",
            "|---|---|---|",
            *shape_rows,
            "",
        ],
    )


if __name__ == "__main__":
    main()
