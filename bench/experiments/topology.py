"""Same-minute A/B of the two process topologies on one bundle: the workers each with their own
ONNX Runtime sessions (the default, the CPU topology) against front-end workers feeding one
engine process (`BERTSERVE_ENGINE_PROCESS`, the GPU topology; service.process.engine_server).

    bertserve bench topology --bundle sst2-minilm --rounds 2

Each round serves the bundle both ways, alternating which goes first, and drives /classify
closed-loop with wrk at each concurrency (single inputs); it also records the resident memory of
all the service's processes and, for the engine process, how many sequences its calls held. On
a CPU the engine process can only add the hop between processes: what it is for (one CUDA
context, the batches of all workers in one call) pays on a GPU. Pause training first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parents[2]
PORT = 8127
ARMS = {"workers": {}, "engine": {"BERTSERVE_ENGINE_PROCESS": "true"}}


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in the server's process group."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        total += int(match.group(1)) if match else 0
    return total / 1024


def engine_rows(metrics: str) -> float | None:
    """Mean sequences in one call of the engine process, from a /metrics scrape."""
    sums = re.findall(r"^bertserve_engine_batch_rows_sum\{[^}]*\} (\S+)", metrics, re.M)
    counts = re.findall(r"^bertserve_engine_batch_rows_count\{[^}]*\} (\S+)", metrics, re.M)
    calls = sum(map(float, counts))
    return sum(map(float, sums)) / calls if calls else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--bundle", default="sst2-minilm")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--levels", default="1,32,64")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", default="workers,engine", help=f"of {list(ARMS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-topology")
    args = parser.parse_args()
    import httpx

    bundles = only_bundles(args.bundles, [args.bundle], args.out / "bundles")
    bodies = write_bodies("classify", args.data, args.out / "inputs")
    ready = bodies.read_text().splitlines()[0].encode()
    levels = [int(x) for x in args.levels.split(",")]
    results = []
    for rnd in range(args.rounds):
        arms = args.arms.split(",")
        order = arms if rnd % 2 == 0 else list(reversed(arms))
        for arm in order:
            log = args.out / f"{arm}-{rnd}.log"
            with serve(OURS, bundles, bundles / args.bundle, PORT, ready, log, ARMS[arm]) as s:
                url = s.url("classify")
                closed_loop(url, bodies, 32, 2)  # warm
                row = {"round": rnd, "arm": arm}
                for c in levels:
                    r = closed_loop(url, bodies, c, args.seconds)
                    row[f"c{c}"] = {"rps": round(r.throughput, 1), "p50_ms": round(r.p50_ms, 2)}
                row["rss_mb"] = round(group_rss_mb(s.proc.pid), 1)
                row["engine_rows"] = engine_rows(httpx.get(f"{s.base}/metrics").text)
                results.append(row)
                cells = " ".join(
                    f"c={c} {row[f'c{c}']['rps']:7.1f}/s p50 {row[f'c{c}']['p50_ms']:6.2f} ms"
                    for c in levels
                )
                print(rnd, f"{arm:8}", cells, f"rss {row['rss_mb']} MB", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
