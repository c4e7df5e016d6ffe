"""`make bench`: bertserve against the raw ceiling and the peers: one machine, same inputs, one run.

    bertserve bench peers [--seconds 8] [--levels 1,8,32,64] [--peers transformers,fastapi-ort,...]

1. Request bodies from the shared data sets (bench/inputs.py).
2. The raw ceiling: the SST-2 bundle's ONNX model in this process on the same token sequences,
   best batch size, no HTTP (bench/ceiling.py), and one batch-1 call for the latency floor.
3. bertserve serving every bundle in bundles/: /classify closed loop at each concurrency level,
   open loop (Poisson) at 50% and 90% of its measured saturation, the other four endpoints at
   concurrency 1 and 32, and the padding ratio from its own /metrics.
4. Each peer (bench/peers/) started, driven on /classify at the same levels, stopped.

Load comes from wrk (closed loop) and bench/loadgen/openloop.py (open loop), both on loopback, both
reporting their own CPU. Writes runs/bench/results.json, docs/reports/benchmarks.md and PNG plots in
docs/reports/img/. Servers and client share the machine's cores: that is stated in the report, and
it is the same for every server.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

from bench.ceiling import measure as measure_ceiling
from bench.inputs import ENDPOINTS, write_bodies
from bench.loadgen import LoadResult, closed_loop, open_loop
from bench.servers import OURS, PEERS, only_bundles, serve
from bertserve.runtime.bundle import load_bundle_spec

ROOT = Path(__file__).resolve().parent.parent
PORT = 8199


def commit() -> str:
    """The commit the measured code is at, with "+changes" when the tree differs from it."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (head or "unknown") + ("+changes" if dirty else "")


def measured_with(command: str) -> str:
    """A report's first words, up to its setup: when, at which commit, on what, by which
    command."""
    return (
        f"Measured on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at {commit()}, "
        f"{platform.machine()} ({platform.processor() or 'cpu'}) with {os.cpu_count()} "
        f"cores, with `{command}`"
    )


def machine() -> dict:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict:
    out: dict[str, str | None] = {}
    for name in (
        "onnxruntime",
        "tokenizers",
        "fastapi",
        "uvicorn",
        "torch",
        "transformers",
        "litserve",
        "ray",
    ):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
    out["wrk"] = (wrk.stdout or wrk.stderr).split()[1] if (wrk.stdout or wrk.stderr) else None
    return out


def metric_sums(base: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram summed over its labels, from /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def drive(url: str, bodies: Path, levels: list[int], seconds: float) -> list[LoadResult]:
    closed_loop(url, bodies, 8, 2)  # warm connections, caches and every lazy path
    results = []
    for level in levels:
        result = closed_loop(url, bodies, level, seconds)
        log(
            f"  c={level:<3} {result.throughput:8.1f} req/s  p50 {result.p50_ms:7.2f} ms  "
            f"p99 {result.p99_ms:7.2f} ms  statuses {result.statuses}  "
            f"client CPU {result.client_cpu_pct:.1f}%"
        )
        results.append(result)
    return results


def model_line(bundle: Path) -> str:
    from bertserve.runtime.bundle import load_bundle_spec

    spec = load_bundle_spec(bundle)
    a = spec.architecture
    return f"{a.layers} layers, hidden {a.hidden_size}, {spec.precision} ONNX"


def served_bundles(bundles: Path, classify: Path) -> list[str]:
    """The bundle under test and every bundle in `bundles` that does not classify."""
    others = [
        d.name
        for d in sorted(bundles.iterdir())
        if (d / "bundle.json").is_file() and "classify" not in load_bundle_spec(d).tasks
    ]
    return [classify.name, *[o for o in others if o != classify.name]]


def runnable_peers(peers: list[str], bundle: Path) -> tuple[list[str], dict[str, str]]:
    """The peers that can serve `bundle`, and why the others cannot: the transformers peer
    rebuilds torch weights from the graph's float32 initializers (a quantised graph has none)."""
    precision = load_bundle_spec(bundle).precision
    if "transformers" in peers and precision != "fp32":
        reason = (
            f"{bundle.name} is {precision}; the transformers peer needs an fp32 bundle "
            "(bertserve export --checkpoint ... --task classify --out DIR, then "
            "--bundles DIR/.. --classify-bundle NAME)"
        )
        return [p for p in peers if p != "transformers"], {"transformers": reason}
    return peers, {}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n")[0],
        epilog=f"example:\n  {prog or 'bertserve bench peers'} --data ../shared/data "
        "--levels 1,8,32 --peers fastapi-ort\n"
        "(needs wrk and the bench extra: `make bench` sets both up)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--classify-bundle", default="sst2-distilled-2x192")
    parser.add_argument(
        "--endpoints",
        default=",".join(ENDPOINTS),
        help="which endpoints besides /classify to drive (their bundles must be in --bundles)",
    )
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "reports" / "benchmarks.md")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    started = time.time()

    log("writing request bodies")
    inputs = {e: write_bodies(e, args.data, args.work / "inputs") for e in ENDPOINTS}
    bundle = args.bundles / args.classify_bundle
    ready = inputs["classify"].read_text().splitlines()[0].encode()

    log("raw ceiling (in process, no HTTP)")
    raw = measure_ceiling(bundle, inputs["classify"])
    log(
        f"  {raw['sequences_per_s']:.0f} sequences/s (batch {raw['best_batch']}); "
        f"one batch-1 call {raw['single_ms']:.3f} ms"
    )

    results: dict = {
        "machine": machine(),
        "versions": versions(),
        "command": "bertserve bench peers "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in (
                ("seconds", args.seconds),
                ("levels", args.levels),
                ("classify_bundle", args.classify_bundle),
            )
        ),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "ceiling": raw,
        "classify_bundle": str(bundle.relative_to(ROOT) if bundle.is_relative_to(ROOT) else bundle),
        "model": model_line(bundle),
        "classify": {},
        "endpoints": {},
        "open_loop": [],
    }

    # bertserve serves the bundle under test for /classify and the other tasks' bundles for the
    # other endpoints: with every shipped bundle, /classify would go to the default model.
    served = only_bundles(args.bundles, served_bundles(args.bundles, bundle), args.work / "bundles")
    peers, skipped = runnable_peers([p for p in args.peers.split(",") if p], bundle)
    results["skipped"] = skipped
    for name, reason in skipped.items():
        log(f"{name}: skipped: {reason}")
    for name in [OURS, *peers]:
        log(f"{name}: starting")
        bundles = served if name == OURS else args.bundles
        with serve(name, bundles, bundle, PORT, ready, args.work / f"{name}.log") as server:
            log(f"{name}: ready in {server.startup_s:.1f} s")
            url = server.url("classify")
            if name == OURS:
                padding0 = metric_sums(server.base, "bertserve_batch_padding_ratio")
            runs = drive(url, inputs["classify"], levels, args.seconds)
            results["classify"][name] = {
                "startup_s": server.startup_s,
                "runs": [r.to_dict() for r in runs],
            }
            if name != OURS:
                continue
            padding1 = metric_sums(server.base, "bertserve_batch_padding_ratio")
            batches = padding1[1] - padding0[1]
            results["padding_ratio"] = (padding1[0] - padding0[0]) / batches if batches else None
            rows_sum = metric_sums(server.base, "bertserve_batch_rows")
            results["mean_batch_rows"] = rows_sum[0] / rows_sum[1] if rows_sum[1] else None
            saturation = max(r.throughput for r in runs)
            for share in (0.5, 0.9):
                rate = round(share * saturation)
                log(f"  open loop at {rate} req/s ({share:.0%} of saturation)")
                result = open_loop(url, inputs["classify"], rate, args.seconds)
                log(
                    f"    p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms "
                    f"statuses {result.statuses} client CPU {result.client_cpu_pct:.1f}%"
                )
                results["open_loop"].append(result.to_dict() | {"share": share})
            for endpoint in args.endpoints.split(","):
                if endpoint in ("classify", ""):
                    continue
                log(f"  /{endpoint}")
                runs = drive(server.url(endpoint), inputs[endpoint], [1, 32], args.seconds)
                results["endpoints"][endpoint] = [r.to_dict() for r in runs]

    results["wall_s"] = time.time() - started
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "results.json").write_text(json.dumps(results, indent=2))
    from bench.report import write_report

    write_report(results, args.report, args.report.parent / "img")
    log(f"wrote {args.report} in {results['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
