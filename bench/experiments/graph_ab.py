"""Two bundles' graphs against each other, batch by batch in one process: is the new one
faster, and by how much.

    bertserve bench graph-ab --data ../shared/data --bundles OLD,NEW [--threads 1] [--passes 8]

Both bundles get the same length-sorted batches of real inputs (bench.models' inputs for the
first bundle's task), and each batch runs on both, the order swapped every batch, so both see
the machine at the same moments; this VM's drift between runs (5-10%) is larger than the effects
this measures. Sessions are the service's (bench.ceiling.load): by default one intra-op thread,
as each worker of the 2-core default has, and no spinning.

Two at a time on purpose. With three sessions alternated forwards and backwards, the middle one
always runs straight after another session while the outer two sometimes follow themselves;
with ONNX Runtime's spinning threads on, that alone made the middle graph 0.84x where pairs of
the same graphs measured 0.99-1.01x (this tool, pairs of the shipped graphs).

Prints each graph's sequences/s, then NEW/OLD for every pass (the spread) and overall.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from bench.ceiling import load
from bench.models import rows_for
from bertserve.runtime.batching import pad_rows


def interleaved(engines: list, batches: list[dict], passes: int) -> list[list[float]]:
    """Seconds each engine spent, per pass, on every batch; the order swapped every batch."""
    spent = [[0.0] * len(engines) for _ in range(passes)]
    for engine in engines:
        engine.run(batches[0])  # warm up both
    for p in range(passes):
        for k, feeds in enumerate(batches):
            order = (0, 1) if (k + p) % 2 == 0 else (1, 0)
            for i in order:
                started = time.perf_counter()
                engines[i].run(feeds)
                spent[p][i] += time.perf_counter() - started
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--bundles", required=True, help="OLD,NEW: two bundle directories")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads a session")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=8)
    args = parser.parse_args()
    paths = [Path(p) for p in args.bundles.split(",")]
    if len(paths) != 2:
        parser.error("--bundles takes exactly two bundle directories (why: this module's doc)")
    loaded = [load(p, threads=args.threads) for p in paths]
    ctx = loaded[0][1]
    task = next(t for t in ctx.spec.tasks if t in ("classify", "ner", "qa"))
    rows = sorted(rows_for(task, ctx, args.data), key=len)
    pad = ctx.spec.tokenizer.pad_id
    batches = [
        pad_rows(rows[i : i + args.batch], pad, None)[0] for i in range(0, len(rows), args.batch)
    ]
    spent = interleaved([engine for engine, _ in loaded], batches, args.passes)
    sequences = len(rows) * args.passes
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.threads} thread(s) each")
    for i, path in enumerate(paths):
        total = sum(p[i] for p in spent)
        print(f"{path}: {sequences / total:,.0f} sequences/s")
    per_pass = " ".join(f"{p[0] / p[1]:.3f}" for p in spent)
    overall = sum(p[0] for p in spent) / sum(p[1] for p in spent)
    print(f"new/old speed per pass: {per_pass}; overall {overall:.3f}x")


if __name__ == "__main__":
    main()
