"""Mixed traffic on one model: an indexer at saturation (/v1/embeddings, 2,048 texts a request,
4 connections) beside an interactive client (/embed of one sentence, Poisson arrivals at
20 requests/s), each alone and then together, on one server at the service's defaults
(priorities: a client batch 1, a single input 0).

    bertserve bench mixed --report docs/reports/mixed.md

The targets (issue #68): beside the indexer, the interactive p50 within 1.5x and p99 within
3x of alone; the indexer's texts/s at least 0.9x of alone.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from bench.experiments import traffic
from bench.loadgen import LoadResult, open_loop
from bench.run import measured_with
from bench.servers import OURS, linked_bundles, serve


def indexer(url: str, texts: list[str], seconds: float, connections: int, size: int) -> dict:
    """`connections` clients sending `size`-text requests back to back for `seconds`: the texts
    a second of the requests answered 200 within the window, and their statuses."""
    done: list[tuple[float, int]] = []  # (ended at, status) of each request
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def client(offset: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = offset
            while time.monotonic() < stop_at:
                batch = [texts[(i + j) % len(texts)] for j in range(size)]
                i += size * connections
                answer = http.post(url, json={"input": batch, "truncate": True})
                with lock:
                    done.append((time.monotonic(), answer.status_code))

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(k * size,)) for k in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = max((t for t, _ in done), default=started) - started
    ok = sum(1 for _, status in done if status == 200)
    statuses: dict[str, int] = {}
    for _, status in done:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"texts_s": ok * size / elapsed if elapsed else 0.0, "statuses": statuses}


def main() -> None:
    parser = traffic.parser(__doc__, port=8221, work="runs/bench-mixed")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rate", type=float, default=20)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args()
    env = traffic.env(args)
    texts = traffic.sentences(args)
    bodies = args.work / "embed-one.jsonl"
    bodies.write_text("\n".join(json.dumps({"inputs": t, "truncate": True}) for t in texts))
    bundles = linked_bundles([args.bundle], args.work / "bundles")
    first = json.dumps({"inputs": "warm up"}).encode()
    results: dict[str, object] = {}
    with serve(
        OURS,
        bundles,
        bundles / args.bundle.name,
        args.port,
        first,
        args.work / "server.log",
        env=env,
        ready_path="/embed",
    ) as server:
        one, bulk = f"{server.base}/embed", f"{server.base}/v1/embeddings"
        indexer(bulk, texts, 5, args.connections, args.size)  # warm: the cost a token measured
        alone = open_loop(one, bodies, args.rate, args.seconds)
        results["interactive alone"] = alone.to_dict()
        results["indexer alone"] = indexer(bulk, texts, args.seconds, args.connections, args.size)
        beside: dict[str, LoadResult] = {}

        def interactive() -> None:
            time.sleep(3)  # the indexer's queue fills first
            beside["load"] = open_loop(one, bodies, args.rate, args.seconds)

        thread = threading.Thread(target=interactive)
        thread.start()
        together = indexer(bulk, texts, args.seconds + 6, args.connections, args.size)
        thread.join()
        results["indexer beside"] = together
        results["interactive beside"] = beside["load"].to_dict()
    i0, i1 = results["interactive alone"], results["interactive beside"]
    x0, x1 = results["indexer alone"], results["indexer beside"]
    assert isinstance(i0, dict) and isinstance(i1, dict)
    assert isinstance(x0, dict) and isinstance(x1, dict)
    table = [
        "| measure | alone | together | together / alone | target |",
        "|---|---|---|---|---|",
        f"| interactive p50 | {i0['p50_ms']:.1f} ms | {i1['p50_ms']:.1f} ms | "
        f"{i1['p50_ms'] / i0['p50_ms']:.2f}x | at most 1.5x |",
        f"| interactive p99 | {i0['p99_ms']:.1f} ms | {i1['p99_ms']:.1f} ms | "
        f"{i1['p99_ms'] / i0['p99_ms']:.2f}x | at most 3x |",
        f"| interactive statuses | {i0['statuses']} | {i1['statuses']} | | |",
        f"| indexer texts/s | {x0['texts_s']:.0f} | {x1['texts_s']:.0f} | "
        f"{x1['texts_s'] / x0['texts_s']:.2f}x | at least 0.9x |",
        f"| indexer statuses | {x0['statuses']} | {x1['statuses']} | | |",
    ]
    command = f"bertserve bench mixed --seconds {args.seconds:g} --rate {args.rate:g}" + "".join(
        f" --env {item}" for item in args.env
    )
    text = "\n".join(
        [
            "# Mixed traffic: an indexer beside an interactive client",
            "",
            f"{measured_with(command)}: one server of `{args.bundle.name}` (the service's "
            f"defaults), an indexer of {args.connections} connections sending {args.size:,}-text "
            "/v1/embeddings requests back to back, and /embed of one SST-2 sentence at "
            f"{args.rate:g} requests/s (Poisson arrivals, latency from the scheduled arrival); "
            f"each alone for {args.seconds:g} s, then together (the interactive client starting "
            "3 s after the indexer).",
            "",
            *table,
            "",
            "```json",
            json.dumps(results),
            "```",
            "",
        ]
    )
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
