"""Client batches: /classify (or /embed) with `--batch` inputs a request at `--connections`
connections, as sequences/s against the raw ONNX Runtime ceiling of the same bundle on the same
sentences, both measured in this run (the ceiling first, then the server, nothing else running),
and the statuses: a client batch should queue, not be refused.

    bertserve bench client-batch --bundle bundles/sst2-distilled-2x192 --data ../shared/data
    bertserve bench client-batch --endpoint embed --bundle bundles/minilm-embed \
        --batch 32 --connections 16 --seconds 20          # an indexer

The throughput issue's target is 90% of the ceiling at 16 inputs x 8 connections; the indexer's
is no refusal and 80% of the ceiling at 32 inputs x 16 connections.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.ceiling import measure
from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, only_bundles, serve


def batched_bodies(single: Path, batch: int, out: Path, endpoint: str = "classify") -> Path:
    """The same sentences, `batch` to a body."""
    texts = [json.loads(line)["inputs"] for line in single.read_text().splitlines() if line]
    cut = {"truncate": True} if endpoint == "embed" else {"parameters": {"truncation": True}}
    lines = [
        json.dumps({"inputs": texts[i : i + batch], **cut})
        for i in range(0, len(texts) - batch + 1, batch)
    ]
    out.write_text("\n".join(lines) + "\n")
    return out


def single_bodies(single: Path, out: Path, endpoint: str) -> Path:
    """The same sentences one to a body, cut to the model's length as the batched ones are."""
    texts = [json.loads(line)["inputs"] for line in single.read_text().splitlines() if line]
    cut = {"truncate": True} if endpoint == "embed" else {"parameters": {"truncation": True}}
    out.write_text("\n".join(json.dumps({"inputs": t, **cut}) for t in texts) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", choices=("classify", "embed"), default="classify")
    parser.add_argument("--bundle", type=Path, default=Path("bundles/sst2-distilled-2x192"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument(
        "--interactive",
        type=int,
        default=0,
        help="also this many connections of single-input requests during the load: their "
        "latency beside that of the same requests alone, same minute",
    )
    parser.add_argument("--work", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    single = write_bodies("classify", args.data, args.work / "inputs")
    raw = measure(args.bundle, single)
    bodies = batched_bodies(
        single,
        args.batch,
        args.work / "inputs" / f"{args.endpoint}-x{args.batch}.jsonl",
        args.endpoint,
    )
    only = only_bundles(args.bundle.parent, [args.bundle.name], args.work / "client-batch-bundles")
    first = bodies.read_text().splitlines()[0].encode()
    log = args.work / "client-batch.log"
    ready = f"/{args.endpoint}"
    with serve(
        OURS, only, only / args.bundle.name, args.port, first, log, ready_path=ready
    ) as server:
        url = f"{server.base}/{args.endpoint}"
        closed_loop(url, bodies, args.connections, 2)  # warm
        alone = beside = None
        if args.interactive:
            singles = single_bodies(
                single, args.work / "inputs" / f"{args.endpoint}-x1.jsonl", args.endpoint
            )
            alone = closed_loop(url, singles, args.interactive, 5)
            with ThreadPoolExecutor(1) as pool:
                during = pool.submit(closed_loop, url, singles, args.interactive, args.seconds - 2)
                load = closed_loop(url, bodies, args.connections, args.seconds)
                beside = during.result()
        else:
            load = closed_loop(url, bodies, args.connections, args.seconds)
    sequences = load.throughput * args.batch
    result = {
        "endpoint": f"/{args.endpoint}",
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
    for name, run in (("interactive_alone", alone), ("interactive_beside_the_load", beside)):
        if run is not None:
            result[name] = {
                "connections": args.interactive,
                "p50_ms": run.p50_ms,
                "p99_ms": run.p99_ms,
                "max_ms": run.extra["max_ms"],
                "statuses": run.statuses,
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
