"""docs/reports/benchmarks.md and its plots from runs/bench/results.json (written by bench/run.py).

bertserve bench report [--results runs/bench/results.json] [--out docs/reports/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.servers import OURS

TARGETS = {
    # single inputs (design.md); client batches: 90% (bertserve bench client-batch)
    "ceiling_share": 0.60,
    "peer_ratio": 1.0,
    "transformers_ratio": 2.0,
    "c1_overhead_ms": 2.0,
    "padding": 0.15,
}


def _by_level(runs: list[dict]) -> dict[int, dict]:
    return {int(r["level"]): r for r in runs}


def headline(results: dict) -> dict:
    ours = _by_level(results["classify"][OURS]["runs"])
    saturation = max(r["throughput"] for r in ours.values())
    out = {
        "saturation": saturation,
        "ceiling": results["ceiling"]["sequences_per_s"],
        "ceiling_share": saturation / results["ceiling"]["sequences_per_s"],
        "padding": results.get("padding_ratio"),
    }
    if 1 in ours:
        out["c1_p50_ms"] = ours[1]["p50_ms"]
        out["c1_overhead_ms"] = ours[1]["p50_ms"] - results["ceiling"]["single_ms"]
    ratios = {}
    for peer, data in results["classify"].items():
        if peer == OURS:
            continue
        theirs = _by_level(data["runs"])
        ratios[peer] = {
            level: ours[level]["throughput"] / max(theirs[level]["throughput"], 1e-9)
            for level in sorted(ours)
            if level in theirs
        }
    out["ratios"] = ratios
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def plots(results: dict, img: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    names = []
    for key, label, fname in (
        ("throughput", "successful requests / s", "bench-throughput.png"),
        ("p99_ms", "p99 latency (ms, log)", "bench-p99.png"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for server, data in results["classify"].items():
            runs = sorted(data["runs"], key=lambda r: r["level"])
            ax.plot(
                [r["level"] for r in runs],
                [r[key] for r in runs],
                marker="o",
                linewidth=2.5 if server == OURS else 1.2,
                label=server,
            )
        if key == "throughput":
            ax.axhline(
                results["ceiling"]["sequences_per_s"],
                color="grey",
                linestyle="--",
                label="raw ceiling",
            )
        else:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent connections (closed loop)")
        ax.set_ylabel(label)
        ax.set_title(f"/classify, SST-2 dev sentences: {label.split(' (')[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def write_report(results: dict, out: Path, img: Path) -> None:
    h = headline(results)
    m, v = results["machine"], results["versions"]
    images = plots(results, img)
    rel = Path("img")
    lines = [
        "# Benchmarks",
        "",
        "bertserve against the raw ONNX Runtime ceiling and the servers users would otherwise use,",
        "on one machine, in one run, with the same model and the same request bodies. Produced by",
        f"`{results['command']}` at commit {results.get('commit', 'unrecorded')} on "
        f"{results['date']} in {results['wall_s'] / 60:.1f} min; every",
        "number below is from that run (raw data: `runs/bench/results.json`, not committed).",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, "
        f"Python {m['python']}. The load generator and the server share these cores.",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
        f"- Model: `{results.get('classify_bundle', 'sst2-distilled-2x192')}` "
        f"({results.get('model', '2 layers, hidden 128')}, ORT fusions on); "
        "inputs: the 872 SST-2 dev sentences in a fixed shuffled order "
        f"(mean {results['ceiling']['mean_tokens']:.1f} tokens, 3 to 60).",
        "- Load: closed loop with `wrk -t1 -c<N>` and `bench/loadgen/replay.lua` (keep-alive, "
        "each connection sends its next body when the last answer arrives); open loop with "
        "Poisson arrivals from `bench/loadgen/openloop.py` (latency from the scheduled arrival).",
        *[f"- Not run: {name}: {why}." for name, why in results.get("skipped", {}).items()],
        "",
        "## Headline",
        "",
        "| figure | target | measured | |",
        "|---|---|---|---|",
        f"| bertserve saturation / raw ceiling (/classify) | >= 60% | "
        f"{h['saturation']:.0f} / {h['ceiling']:.0f} req/s = **{h['ceiling_share']:.0%}** | "
        f"{_verdict(h['ceiling_share'] >= TARGETS['ceiling_share'])} |",
    ]
    if "c1_overhead_ms" in h:
        lines.append(
            f"| p50 at concurrency 1 minus one raw batch-1 call | <= 2 ms | "
            f"{h['c1_p50_ms']:.2f} - {results['ceiling']['single_ms']:.2f} = "
            f"**{h['c1_overhead_ms']:.2f} ms** | "
            f"{_verdict(h['c1_overhead_ms'] <= TARGETS['c1_overhead_ms'])} |"
        )
    for peer, ratios in h["ratios"].items():
        hi = {lv: r for lv, r in ratios.items() if lv >= 8}
        if not hi:
            continue
        need = TARGETS["transformers_ratio"] if peer == "transformers" else TARGETS["peer_ratio"]
        shown = ", ".join(f"c={lv}: {r:.2f}x" for lv, r in hi.items())
        lines.append(
            f"| throughput vs {peer}, concurrency >= 8 | >= {need:g}x | {shown} | "
            f"{_verdict(min(hi.values()) >= need)} |"
        )
    if h["padding"] is not None:
        lines.append(
            f"| padding ratio, mixed lengths (mean over batches) | <= 15% | "
            f"**{h['padding']:.1%}** (mean batch {results.get('mean_batch_rows') or 0:.1f} rows) | "
            f"{_verdict(h['padding'] <= TARGETS['padding'])} |"
        )
    c = results["ceiling"]
    per_size = ", ".join(f"batch {k}: {val:.0f}/s" for k, val in c["per_batch_size"].items())
    lines += [
        "",
        f"Raw ceiling: {c['sequences_per_s']:.0f} sequences/s at batch {c['best_batch']} "
        f"({per_size}, length-sorted); one batch-1 call {c['single_ms']:.3f} ms (median)."
        + (
            f" The same batch sizes unsorted, as a server forms them: "
            f"{c['unsorted']['sequences_per_s']:.0f} sequences/s at batch "
            f"{c['unsorted']['best_batch']}; every ratio above is to the sorted ceiling."
            if "unsorted" in c
            else ""
        ),
        "",
        "## /classify: every server, closed loop",
        "",
        *[f"![{name}]({rel / name})" for name in images],
        "",
        "| server | start-up | concurrency | req/s | p50 ms | p95 ms | p99 ms | non-200 | "
        "socket errors | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for server, data in results["classify"].items():
        for r in sorted(data["runs"], key=lambda r: r["level"]):
            non200 = {k: n for k, n in r["statuses"].items() if k != "200"}
            lines.append(
                f"| {server} | {data['startup_s']:.0f} s | {int(r['level'])} | "
                f"{r['throughput']:.1f} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {non200 or 0} | {r['errors']} | "
                f"{r['client_cpu_pct']:.1f}% |"
            )
    lines += [
        "",
        "## bertserve, open loop (Poisson arrivals) on /classify",
        "",
        "| offered req/s | share of saturation | answered req/s | p50 ms | p95 ms | p99 ms | "
        "statuses | client CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["open_loop"]:
        lines.append(
            f"| {r['level']:.0f} | {r['share']:.0%} | {r['throughput']:.1f} | {r['p50_ms']:.2f} | "
            f"{r['p95_ms']:.2f} | {r['p99_ms']:.2f} | {r['statuses']} | "
            f"{r['client_cpu_pct']:.1f}% |"
        )
    lines += [
        "",
        "## bertserve, the other endpoints (closed loop)",
        "",
        "| endpoint | inputs | concurrency | req/s | p50 ms | p95 ms | p99 ms | statuses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    described = {
        "ner": "CoNLL-2003 test sentences",
        "qa": "SQuAD dev question + context (256-token windows)",
        "fill-mask": "SQuAD dev sentences, one word masked",
        "nsp": "consecutive SQuAD dev sentences",
    }
    for endpoint, runs in results["endpoints"].items():
        for r in runs:
            lines.append(
                f"| /{endpoint} | {described.get(endpoint, '')} | {int(r['level'])} | "
                f"{r['throughput']:.1f} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {r['statuses']} |"
            )
    lines += ["", *NOTES]
    out.write_text("\n".join(lines) + "\n")


NOTES = [
    "## How to read this",
    "",
    "- Requests/s counts 200 answers only. Every server sees the same bodies in the same order.",
    "- The peers serve the same model: `transformers` gets its weights out of the bundle's ONNX",
    "  file and checks its logits against ONNX Runtime at start-up (max difference 1e-4); the",
    "  other three run the bundle's ONNX file. Batching peers use the service's defaults (up to",
    "  32 rows, 2 ms wait); every ONNX Runtime session uses every core for one call.",
    "- Client CPU is the load generator's own CPU time over the run, as a share of one core. On 2",
    "  cores, CPU the client uses is CPU the server cannot: wrk keeps it to a few percent.",
    "- Start-up is from process start to the first 200 on /classify (bertserve loads and warms",
    "  the bundle under test and the other tasks' bundles).",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path("runs/bench/results.json"))
    parser.add_argument("--out", type=Path, default=Path("docs/reports/benchmarks.md"))
    args = parser.parse_args()
    write_report(json.loads(args.results.read_text()), args.out, args.out.parent / "img")


if __name__ == "__main__":
    main()
