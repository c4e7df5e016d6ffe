"""Two API keys on one model past saturation: fair shares by weight (issue #68's targets).

    bertserve bench tenants --report docs/reports/tenants.md

One server of two workers (the bundle's /v1/embeddings, `--size` texts a request) with a keys
file of two tenants, a and b, is driven twice:
1. weights 1:1, b at `--rate` requests/s alone, then b again beside a at 10x b's rate (past the
   machine's saturation): b's p99 at most 2x alone, b refused nothing, a gets what is left;
2. weights 3:1, a and b each at 10x b's rate: the rows the model served
   (`bertserve_tenant_rows_total`) split 3:1 within 10 %.
Arrivals are Poisson (open loop), latency from the scheduled arrival.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.experiments import traffic
from bench.loadgen import LoadResult, open_loop
from bench.run import measured_with
from bench.servers import OURS, Server, linked_bundles, serve

KEYS = {"a": "tenant-a-" + "a" * 24, "b": "tenant-b-" + "b" * 24}


def keys_file(path: Path, weights: dict[str, int]) -> Path:
    path.write_text(
        "".join(f'[{name}]\nkey = "{KEYS[name]}"\nweight = {w}\n\n' for name, w in weights.items())
    )
    return path


def tenant_rows(base: str) -> dict[str, float]:
    """Rows served per tenant so far (every worker's, through the shared metrics directory)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    rows: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "bertserve_tenant_rows":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    tenant = sample.labels["tenant"]
                    rows[tenant] = rows.get(tenant, 0.0) + sample.value
    return rows


def together(url: str, rates: dict[str, float], bodies: Path, seconds: float) -> dict:
    """Each tenant's open loop at its rate, started together: {tenant: result}."""
    results: dict[str, LoadResult] = {}

    def run(name: str) -> None:
        headers = {"Authorization": f"Bearer {KEYS[name]}"}
        results[name] = open_loop(
            url, bodies, rates[name], seconds, seed=ord(name), headers=headers
        )

    threads = [threading.Thread(target=run, args=(name,)) for name in rates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {name: results[name].to_dict() for name in rates}


def phase(
    args: argparse.Namespace, weights: dict[str, int], tag: str
) -> AbstractContextManager[Server]:
    """A server with `weights`; yields it once warm."""
    work = args.work
    bundles = linked_bundles([args.bundle], work / "bundles")
    env = {
        "BERTSERVE_WORKERS": str(args.workers),
        "BERTSERVE_KEYS_FILE": str(keys_file(work / f"keys-{tag}.toml", weights)),
        **traffic.env(args),
    }
    warm = json.dumps({"input": ["warm up"]}).encode()
    return serve(
        OURS,
        bundles,
        bundles / args.bundle.name,
        args.port,
        warm,
        work / f"server-{tag}.log",
        env=env,
        ready_path="/v1/embeddings",
        headers={"Authorization": f"Bearer {KEYS['b']}"},
    )


def main() -> None:
    parser = traffic.parser(__doc__, port=8223, work="runs/bench-tenants")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rate", type=float, default=10, help="b's requests/s (a: 10x)")
    parser.add_argument("--size", type=int, default=8, help="texts a request")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    work = args.work
    texts = traffic.sentences(args)
    bodies = work / f"embed-{args.size}.jsonl"
    bodies.write_text(
        "\n".join(
            json.dumps({"input": [texts[(i + j) % len(texts)] for j in range(args.size)]})
            for i in range(0, len(texts), args.size)
        )
    )
    flood = 10 * args.rate
    results: dict[str, object] = {}
    with phase(args, {"a": 1, "b": 1}, "equal") as server:
        url = f"{server.base}/v1/embeddings"
        together(url, {"a": flood}, bodies, 5)  # warm both workers at saturation
        results["b alone"] = together(url, {"b": args.rate}, bodies, args.seconds)["b"]
        before = tenant_rows(server.base)
        beside = together(url, {"a": flood, "b": args.rate}, bodies, args.seconds)
        after = tenant_rows(server.base)
        results["a beside"], results["b beside"] = beside["a"], beside["b"]
        results["equal rows"] = {t: after.get(t, 0) - before.get(t, 0) for t in ("a", "b")}
    time.sleep(1)
    with phase(args, {"a": 3, "b": 1}, "3to1") as server:
        url = f"{server.base}/v1/embeddings"
        together(url, {"a": flood}, bodies, 5)
        before = tenant_rows(server.base)
        both = together(url, {"a": flood, "b": flood}, bodies, args.seconds)
        after = tenant_rows(server.base)
        results["a 3:1"], results["b 3:1"] = both["a"], both["b"]
        results["3:1 rows"] = {t: after.get(t, 0) - before.get(t, 0) for t in ("a", "b")}
    text = report(args, results)
    print(text)
    if args.report:
        args.report.write_text(text)


def refused(result: dict) -> int:
    return sum(n for status, n in result["statuses"].items() if status != "200") + result["errors"]


def report(args: argparse.Namespace, results: dict) -> str:
    b0, b1, a1 = results["b alone"], results["b beside"], results["a beside"]
    rows3 = results["3:1 rows"]
    split = rows3["a"] / rows3["b"] if rows3["b"] else float("inf")
    a3, b3 = results["a 3:1"], results["b 3:1"]
    table = [
        "| measure | measured | target |",
        "|---|---|---|",
        f"| b p99 alone / beside a (1:1) | {b0['p99_ms']:.1f} / {b1['p99_ms']:.1f} ms: "
        f"{b1['p99_ms'] / b0['p99_ms']:.2f}x | at most 2x |",
        f"| b p50 alone / beside a (1:1) | {b0['p50_ms']:.1f} / {b1['p50_ms']:.1f} ms | |",
        f"| b refused beside a (1:1) | {refused(b1)} of {b1['requests']} | 0 |",
        f"| a beside b (1:1): answered / refused | {a1['statuses'].get('200', 0)} / "
        f"{refused(a1)} of {a1['requests']} | what is left |",
        f"| rows served a : b (1:1) | {results['equal rows']['a']:.0f} : "
        f"{results['equal rows']['b']:.0f} | b all it sent |",
        f"| rows served a : b (3:1, both flooding) | {rows3['a']:.0f} : {rows3['b']:.0f} = "
        f"{split:.2f} : 1 | 3 : 1 within 10 % (2.7 to 3.3) |",
        f"| answered a / b (3:1) | {a3['statuses'].get('200', 0)} / "
        f"{b3['statuses'].get('200', 0)} of {a3['requests']} / {b3['requests']} | |",
    ]
    command = (
        f"bertserve bench tenants --seconds {args.seconds:g} --rate {args.rate:g} "
        f"--size {args.size}" + "".join(f" --env {item}" for item in args.env)
    )
    return "\n".join(
        [
            "# Two API keys on one model past saturation",
            "",
            f"{measured_with(command)}: one server of `{args.bundle.name}` with "
            f"{args.workers} workers (the service's defaults otherwise) and a keys file of two "
            f"tenants; /v1/embeddings of {args.size} SST-2 sentences a request, Poisson "
            f"arrivals, latency from the scheduled arrival. b sends {args.rate:g} requests/s, "
            f"a {10 * args.rate:g} (past what the machine answers); {args.seconds:g} s each.",
            "",
            *table,
            "",
            "```json",
            json.dumps(results),
            "```",
            "",
        ]
    )


if __name__ == "__main__":
    main()
