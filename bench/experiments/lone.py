"""A lone request: bertserve's p50 at one connection against the FastAPI + ONNX Runtime peer on
the same bundle, and its throughput at 32 connections, in alternating rounds.

    bertserve bench lone --bundle sst2-distilled-2x192 [--arms bertserve,fastapi-ort]
        [--rounds 3] [--seconds 6] [--levels 1,32] [--env ARM:KEY=VALUE,...]
    bertserve bench lone --bundle squad-minilm --endpoint qa --arms bertserve,bertserve+ort \
        --env ort:BERTSERVE_ENGINE=ort

An arm is a server: `bertserve` (its default settings), a peer of bench/peers, or a bertserve
variant named `bertserve+NAME` whose settings come from `--env NAME:BERTSERVE_X=1,...` (several
--env flags). Every arm serves only `--bundle` (/classify on SST-2 sentences, or `--endpoint`
with its bench bodies: bertserve arms only), one arm at a time,
the order reversed every round; wrk drives it closed-loop at each level. Prints each arm's p50
(ms) and requests/s, the median over rounds, and the p50 difference to the peer. Pause any
background job first: the two cores are the measurement.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
from pathlib import Path

from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.run import commit
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parents[2]
PORT = 8131
PEER = "fastapi-ort"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="sst2-distilled-2x192")
    parser.add_argument("--arms", default=f"{OURS},{PEER}")
    parser.add_argument("--env", action="append", default=[], help="NAME:KEY=VALUE,...")
    parser.add_argument("--levels", default="1,32")
    parser.add_argument(
        "--endpoint", default="classify", help="bertserve arms only, for another than classify"
    )
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "lone")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()

    envs: dict[str, dict[str, str]] = {}
    for spec in args.env:
        name, _, pairs = spec.partition(":")
        envs[name] = dict(p.split("=", 1) for p in pairs.split(",") if p)
    arms = args.arms.split(",")
    levels = [int(x) for x in args.levels.split(",")]
    bundle = ROOT / "bundles" / args.bundle
    bundles = only_bundles(ROOT / "bundles", [args.bundle], args.work / "bundles")
    if args.endpoint != "classify" and any(not a.startswith(OURS) for a in arms):
        parser.error("the peers serve /classify only: --endpoint takes bertserve arms")
    bodies = write_bodies(args.endpoint, args.data, args.work / "inputs")
    ready = (
        b'{"inputs": "a charming film"}'
        if args.endpoint == "classify"
        else bodies.read_text().split("\n")[0].encode()
    )
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else list(reversed(arms)):
            server, _, variant = arm.partition("+")
            env = {"BERTSERVE_LOG_LEVEL": "warning"} | envs.get(variant, {})
            log = args.work / f"{arm}.log"
            with serve(
                server, bundles, bundle, PORT, ready, log, env, ready_path=f"/{args.endpoint}"
            ) as live:
                url = live.url(args.endpoint)
                closed_loop(url, bodies, 8, 2)  # warm connections, caches, lazy paths
                for level in levels:
                    res = closed_loop(url, bodies, level, args.seconds)
                    results.setdefault((arm, level), []).append((res.p50_ms, res.throughput))
            print(json.dumps({"round": r, "arm": arm}), flush=True)

    def median(arm: str, level: int, i: int) -> float:
        return statistics.median(x[i] for x in results[(arm, level)])

    env_flags = "".join(f" --env {e}" for e in args.env)
    lines = [
        f"# A lone request: `{args.bundle}` against the plain FastAPI + ONNX Runtime server"
        if PEER in arms
        else f"# `{args.bundle}` on /{args.endpoint}: {', '.join(arms)}",
        "",
        f"Measured on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at {commit()}, "
        f"{platform.machine()} with {os.cpu_count()} cores, with `bertserve bench lone "
        f"--bundle {args.bundle} --endpoint {args.endpoint} --arms {args.arms}{env_flags} "
        f"--levels {args.levels} --rounds "
        f"{args.rounds} --seconds {args.seconds:g}`: medians over the alternated rounds"
        + (
            "; the peer is bench/peers/ort_plain.py (no batching, its threads on every core, "
            "spinning)."
            if PEER in arms
            else "."
        ),
        "",
        "| arm | "
        + " | ".join(f"p50 ms @{c} | req/s @{c}" for c in levels)
        + " | p50 @1 - peer's |",
        "|---|" + "---|---|" * len(levels) + "---|",
    ]
    for arm in arms:
        cells = " | ".join(f"{median(arm, c, 0):.2f} | {median(arm, c, 1):,.0f}" for c in levels)
        gap = (
            f"{median(arm, 1, 0) - median(PEER, 1, 0):+.2f} ms"
            if PEER in arms and 1 in levels
            else ""
        )
        lines.append(f"| {arm} | {cells} | {gap} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
