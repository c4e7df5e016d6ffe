"""One raw batch-1 call of a /classify bundle, back to back and after an idle gap.

    bertserve bench idle-gap --bundle bundles/sst2-minilm --gaps 1,3,10 --rounds 3

The lone-request target compares a request's p50 with one raw call timed back to back. A lone
request's call never runs back to back: its worker's model thread waits through the client's
round trip, the HTTP parsing and the tokenising first. This times the same batch-1 calls (real
SST-2 sentences, the service's Engine) with nothing between them, after each gap spent sleeping,
and after each gap spent spinning on the clock (the core never halts), at one intra-op thread
(a worker's share on the 2-core default) and at every core. Orders alternate every round.
Nothing else may run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.ceiling import call_ms, classify_rows, load, single_feeds
from bench.inputs import write_bodies

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "sst2-minilm")
    parser.add_argument("--gaps", default="1,3,10", help="idle ms before a call, comma-separated")
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    parser.add_argument("--count", type=int, default=200, help="calls a cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "idle-gap")
    args = parser.parse_args()

    bodies = write_bodies("classify", args.data, args.work / "inputs")
    cells = [("back to back", 0.0, False)]
    for gap in (float(g) for g in args.gaps.split(",")):
        cells += [(f"{gap:g} ms slept", gap / 1000, False), (f"{gap:g} ms spun", gap / 1000, True)]
    results: dict[tuple[int, str], list[float]] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        engine, ctx = load(args.bundle, threads)
        pad = ctx.spec.tokenizer.pad_id
        feeds = single_feeds(classify_rows(ctx, bodies), pad, args.count)
        call_ms(engine, feeds[:20], 0.0, False)  # warm-up
        for r in range(args.rounds):
            for name, gap_s, spin in cells if r % 2 == 0 else cells[::-1]:
                ms = call_ms(engine, feeds, gap_s, spin)
                results.setdefault((threads, name), []).append(ms)
                line = {"round": r, "threads": threads, "cell": name, "median_ms": round(ms, 3)}
                print(json.dumps(line), flush=True)
        del engine
    print(f"\n{args.bundle.name}: median ms of a batch-1 call, {args.count} SST-2 sentences a cell")
    print("| threads | " + " | ".join(name for name, _, _ in cells) + " |")
    print("|---|" + "---|" * len(cells))
    for threads in sorted({t for t, _ in results}):
        row = [" / ".join(f"{ms:.2f}" for ms in results[threads, name]) for name, _, _ in cells]
        print(f"| {threads} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
