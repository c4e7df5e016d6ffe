"""Workers x ONNX Runtime threads for one /classify bundle: the p50 of a lone request and the
saturation, each layout served in turn and the order alternated every round.

    python -m bench.threads --bundle bundles/sst2-minilm --layouts 2x1,2x2 --rounds 5

A layout is WORKERSxTHREADS (`BERTSERVE_WORKERS`, `BERTSERVE_INTRA_OP_THREADS`). wrk closed
loop at 1, 32 and 64 connections, 6 s a level after a 2 s warm-up. One raw batch-1 call of the
bundle with every core is measured first: the floor under the p50. Nothing else may run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.ceiling import classify_rows, load, single_latency_ms
from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "sst2-minilm")
    parser.add_argument("--layouts", default="2x1,2x2", help="WORKERSxTHREADS, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "threads")
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()

    bodies = write_bodies("classify", args.data, args.work / "inputs")  # SST-2 dev sentences
    engine, ctx = load(args.bundle, os.cpu_count() or 1)
    rows = classify_rows(ctx, bodies)
    raw = single_latency_ms(engine, rows, ctx.spec.tokenizer.pad_id)
    del engine
    print(json.dumps({"raw_single_ms": round(raw, 2)}), flush=True)
    bundles = only_bundles(args.bundle.parent, [args.bundle.name], args.work / "bundles")
    layouts = [tuple(x.split("x")) for x in args.layouts.split(",")]
    log, ready = args.work / "server.log", b'{"inputs": "a charming film"}'
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for workers, threads in layouts if r % 2 == 0 else layouts[::-1]:
            env = {
                "BERTSERVE_WORKERS": workers,
                "BERTSERVE_INTRA_OP_THREADS": threads,
                "BERTSERVE_LOG_LEVEL": "warning",
            }
            with serve(OURS, bundles, bundles, args.port, ready, log, env) as server:
                url = server.url("classify")
                closed_loop(url, bodies, 8, 2)  # warm-up
                res = {c: closed_loop(url, bodies, c, 6) for c in LEVELS}
            layout = f"{workers}x{threads}"
            line = {"round": r, "layout": layout, "c1_p50_ms": res[1].p50_ms}
            line |= {f"c{c}_req_s": res[c].throughput for c in LEVELS}
            results.setdefault(layout, []).append(line)
            print(json.dumps(line), flush=True)
    print(f"\nraw batch-1 call, {os.cpu_count()} threads: {raw:.2f} ms")
    print("| workers x threads | c=1 p50 ms | c=32 req/s | c=64 req/s |")
    print("|---|---|---|---|")
    for layout, lines in results.items():
        cells = [
            " / ".join(f"{x[key]:,.{digits}f}" for x in lines)
            for key, digits in (("c1_p50_ms", 2), ("c32_req_s", 0), ("c64_req_s", 0))
        ]
        print(f"| {layout} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
