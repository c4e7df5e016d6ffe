"""Client batches: /classify with `--batch` inputs a request at `--connections` connections,
as sequences/s against the raw ONNX Runtime ceiling of the same bundle on the same sentences,
both measured in this run (the ceiling first, then the server, nothing else running).

    python -m bench.client_batch --bundle bundles/sst2-distilled-2x192 --data ../shared/data

The throughput issue's target is 90% of the ceiling at 16 inputs x 8 connections.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.ceiling import measure
from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, only_bundles, serve


def batched_bodies(single: Path, batch: int, out: Path) -> Path:
    """The same sentences, `batch` to a body."""
    texts = [json.loads(line)["inputs"] for line in single.read_text().splitlines() if line]
    lines = [
        json.dumps({"inputs": texts[i : i + batch], "parameters": {"truncation": True}})
        for i in range(0, len(texts) - batch + 1, batch)
    ]
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/sst2-distilled-2x192"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--work", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    single = write_bodies("classify", args.data, args.work / "inputs")
    raw = measure(args.bundle, single)
    bodies = batched_bodies(
        single, args.batch, args.work / "inputs" / f"classify-x{args.batch}.jsonl"
    )
    only = only_bundles(args.bundle.parent, [args.bundle.name], args.work / "client-batch-bundles")
    first = bodies.read_text().splitlines()[0].encode()
    log = args.work / "client-batch.log"
    with serve(OURS, only, only / args.bundle.name, args.port, first, log) as server:
        url = f"{server.base}/classify"
        closed_loop(url, bodies, args.connections, 2)  # warm
        load = closed_loop(url, bodies, args.connections, args.seconds)
    sequences = load.throughput * args.batch
    result = {
        "bundle": args.bundle.name,
        "batch": args.batch,
        "connections": args.connections,
        "requests_per_s": load.throughput,
        "sequences_per_s": sequences,
        "ceiling_sequences_per_s": raw["sequences_per_s"],
        "ceiling_batch": raw["best_batch"],
        "share_of_ceiling": sequences / raw["sequences_per_s"],
        "p50_ms": load.p50_ms,
        "statuses": load.statuses,
        "client_cpu_pct": load.client_cpu_pct,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
