"""Where the machine's CPU goes per request at saturation: the serving processes' event loops,
their model threads, the supervisor, the load generator and the kernel, from /proc, for
bertserve and for the HTTP floor (uvicorn answering a constant, `bench.peers.floor`).

    bertserve bench cpu-split --bundle sst2-distilled-2x192 --levels 32,64 --rounds 2
    bertserve bench cpu-split --endpoint qa --bundles runs/ab/bundles-v2 --bundle squad-qa \
        --beside sst2-classify --arms bertserve

Another endpoint than /classify serves its bundle with a classify bundle beside it (`--beside`:
the servers' readiness is a /classify answer); only bertserve arms serve it.

A py-spy profile shows where a thread's wall time goes, including its waits for the GIL and for
a core. This counts CPU time: each thread's utime + stime (/proc/PID/task/TID/stat) and the
whole machine's (/proc/stat) over one closed-loop wrk run, divided by the answers. On a machine
whose cores are shared by the server and its client, the sum of the parts is what a request
costs, and the cores / that sum is the most any server built this way can answer. Pause
training first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, from_tree, only_bundles, serve

ROOT = Path(__file__).resolve().parents[2]
PORT = 8131
TICK = os.sysconf("SC_CLK_TCK")


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _cpu_s(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def threads_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds so far of the group's threads, by role: each serving process's main thread
    (its event loop), their other threads (the model's calls, thread pools) and, where the
    group's leader only supervises worker processes, the leader. Threads that ended are not
    counted: the servers keep theirs alive."""
    roles = {"supervisor": 0.0, "loops": 0.0, "other threads": 0.0}
    pids = _group_pids(pgid)
    supervised = len(pids) > 1  # a leader with workers: bertserve's supervisor, uvicorn's
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                cpu = _cpu_s(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
            except OSError:
                continue
            if pid == pgid and supervised:
                roles["supervisor"] += cpu
            else:
                roles["loops" if int(tid) == pid else "other threads"] += cpu
    return roles


def machine_cpu() -> tuple[float, float, float]:
    """(busy, idle, stolen) CPU seconds of the whole machine so far; busy excludes stolen time
    (the hypervisor's), which is reported on its own."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle, steal = values[3] + values[4], values[7]  # idle + iowait; steal
    return (sum(values[:8]) - idle - steal) / TICK, idle / TICK, steal / TICK


def batch_rows(metrics: str) -> tuple[float, float]:
    """(sequences, model calls) so far, from a /metrics scrape; (0, 0) where there are none."""
    rows = re.findall(r"^bertserve_batch_rows_sum\{[^}]*\} (\S+)", metrics, re.M)
    calls = re.findall(r"^bertserve_batch_rows_count\{[^}]*\} (\S+)", metrics, re.M)
    return sum(map(float, rows)), sum(map(float, calls))


def measure(base: str, url: str, pgid: int, bodies: Path, c: int, seconds: float) -> dict:
    """One closed-loop run at `c` connections: CPU microseconds per answer by part."""
    import httpx

    def scrape() -> tuple[float, float]:
        try:
            return batch_rows(httpx.get(f"{base}/metrics", timeout=10).text)
        except httpx.HTTPError:
            return 0.0, 0.0

    rows0, threads0, (busy0, idle0, steal0) = scrape(), threads_cpu(pgid), machine_cpu()
    result = closed_loop(url, bodies, c, seconds)
    rows1, threads1, (busy1, idle1, steal1) = scrape(), threads_cpu(pgid), machine_cpu()
    answers = max(result.ok, 1)
    us = {role: 1e6 * (threads1[role] - threads0[role]) / answers for role in threads0}
    us["client"] = 1e6 * result.client_cpu_s / answers
    served = sum(us.values())
    us["kernel and the rest"] = 1e6 * (busy1 - busy0) / answers - served
    us["idle"] = 1e6 * (idle1 - idle0) / answers
    us["stolen"] = 1e6 * (steal1 - steal0) / answers
    calls = rows1[1] - rows0[1]
    return {
        "c": c,
        "rps": round(result.throughput, 1),
        "p50_ms": round(result.p50_ms, 3),
        "non_200": result.requests - result.ok,
        "errors": result.errors,
        "rows_per_call": round((rows1[0] - rows0[0]) / calls, 2) if calls else None,
        "us_per_answer": {k: round(v, 1) for k, v in us.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--bundle", default="sst2-distilled-2x192")
    parser.add_argument("--endpoint", default="classify", help="the endpoint driven")
    parser.add_argument(
        "--beside", default="", help="bundles served beside --bundle (comma-separated)"
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--levels", default="32,64")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--arms",
        default="bertserve,http-floor",
        help="bertserve, a name given to --tree, or a peer or probe of bench.servers",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve bertserve from another source tree as arm NAME (A/B against the code)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-cpu-split")
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="each round, first the raw ceiling and its CPU a sequence (bench.ceiling)",
    )
    args = parser.parse_args()

    if args.ceiling and args.endpoint != "classify":
        parser.error("--ceiling measures /classify's bundle on its texts: only with classify")
    args.out = args.out.resolve()  # the servers may run from another tree (--old)
    beside = [b for b in args.beside.split(",") if b]
    bundles = only_bundles(args.bundles, [args.bundle, *beside], args.out / "bundles")
    bodies = write_bodies(args.endpoint, args.data, args.out / "inputs")
    classify = (
        bodies
        if args.endpoint == "classify"
        else write_bodies("classify", args.data, args.out / "inputs")
    )
    ready = classify.read_text().split("\n")[0]
    levels = [int(x) for x in args.levels.split(",")]
    trees = dict(t.split("=", 1) for t in args.tree)
    results = []
    for rnd in range(args.rounds):
        if args.ceiling:
            from bench.ceiling import measure as raw_ceiling

            raw = raw_ceiling(bundles / args.bundle, bodies)
            row = {
                "round": rnd,
                "arm": "raw ceiling",
                "sequences_per_s": round(raw["sequences_per_s"], 1),
                "best_batch": raw["best_batch"],
                "cpu_us_per_sequence": round(raw["cpu_us_per_sequence"], 1),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
        arms = args.arms.split(",")
        for arm in arms if rnd % 2 == 0 else reversed(arms):
            name = OURS if arm == "bertserve" or arm in trees else arm
            # another tree's arm: that tree's code, not the installed `bertserve` (this one)
            launch = from_tree(Path(trees[arm]), args.out) if arm in trees else None
            log = args.out / f"{arm}-{rnd}.log"
            with serve(
                name,
                bundles,
                bundles / args.bundle,
                PORT,
                ready.encode(),
                log,
                env=launch.env if launch else None,
                cwd=launch.cwd if launch else None,
                module=launch.module if launch else "bertserve.service",
            ) as s:
                url = s.url(args.endpoint)
                closed_loop(url, bodies, 32, 2)  # warm
                time.sleep(0.5)
                for c in levels:
                    row = {"round": rnd, "arm": arm} | measure(
                        s.base, url, s.proc.pid, bodies, c, args.seconds
                    )
                    results.append(row)
                    print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
