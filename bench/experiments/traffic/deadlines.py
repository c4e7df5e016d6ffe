"""Deadlines under a full queue: while an indexer keeps a model's queue seconds deep (client
batches of /embed, 4 connections), 1,000 single-text /embed requests with a 50 ms timeout of
their own (X-Request-Timeout-Ms: 50) and a priority below the indexer's (X-Request-Priority:
5) are sent at 16 at a time. Every one should be answered 504 on time, none 200 after its
deadline, and no model time spent on them (bertserve_unanswered_model_seconds_total and
bertserve_dropped_rows_total, read from /metrics before and after).

    bertserve bench deadlines --report docs/reports/deadlines.md
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx

from bench.experiments import traffic
from bench.run import measured_with
from bench.servers import OURS, linked_bundles, serve

READING = """The client's clock starts before the server sees a request and stops after its
answer is written: a 200 that the server's last deadline check passed (after the answer is
made, before it is written) can still reach the client after its timeout while the event loop
is busy with the indexer's bodies, and a 504 comes as late as that loop lets its timer run.
The deadline counts from when the app first saw the request (its outermost middleware)."""


def metric(text: str, family: str, reason: str) -> float:
    """The sum over models of `family{...,reason="<reason>"}` in a Prometheus exposition."""
    pattern = re.compile(rf'^{family}\{{[^}}]*reason="{reason}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def indexer(url: str, texts: list[str], stop: threading.Event, latencies: list[float]) -> None:
    """Client batches of 512 texts, back to back, until `stop`."""
    with httpx.Client(timeout=120) as client:
        i = 0
        while not stop.is_set():
            batch = [texts[(i + j) % len(texts)] for j in range(512)]
            i += 512
            started = time.monotonic()
            answer = client.post(url, json={"inputs": batch, "truncate": True})
            if answer.status_code == 200:
                latencies.append(time.monotonic() - started)


async def timed(url: str, texts: list[str], n: int, timeout_ms: float) -> list[tuple[int, float]]:
    """`n` single-text requests with their own timeout, 16 at a time: (status, seconds)."""
    room = asyncio.Semaphore(16)
    headers = {"X-Request-Timeout-Ms": f"{timeout_ms:g}", "X-Request-Priority": "5"}
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one(i: int) -> tuple[int, float]:
            async with room:
                started = time.monotonic()
                answer = await client.post(
                    url, json={"inputs": texts[i % len(texts)]}, headers=headers
                )
                return answer.status_code, time.monotonic() - started

        return await asyncio.gather(*(one(i) for i in range(n)))


def main() -> None:
    parser = traffic.parser(__doc__, port=8211, work="runs/bench-deadlines")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--timeout-ms", type=float, default=50)
    args = parser.parse_args()
    texts = traffic.sentences(args)
    bundles = linked_bundles([args.bundle], args.work / "bundles")
    first = json.dumps({"inputs": "warm up"}).encode()
    with serve(
        OURS,
        bundles,
        bundles / args.bundle.name,
        args.port,
        first,
        args.work / "server.log",
        env=traffic.env(args),
        ready_path="/embed",
    ) as server:
        url = f"{server.base}/embed"
        with httpx.Client(timeout=60) as client:  # the cost a token measured: a full rate
            for _ in range(3):
                client.post(url, json={"inputs": texts[:512], "truncate": True})
            before = client.get(f"{server.base}/metrics").text
        stop, bulk = threading.Event(), list[float]()
        threads = [
            threading.Thread(target=indexer, args=(url, texts, stop, bulk)) for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        time.sleep(5)  # the queue fills
        started = time.monotonic()
        answers = asyncio.run(timed(url, texts, args.requests, args.timeout_ms))
        sent_s = time.monotonic() - started
        stop.set()
        for thread in threads:
            thread.join()
        with httpx.Client(timeout=60) as client:
            after = client.get(f"{server.base}/metrics").text
    deadline_s = args.timeout_ms / 1000
    statuses: dict[int, int] = {}
    for status, _ in answers:
        statuses[status] = statuses.get(status, 0) + 1
    late_ok = sum(1 for status, s in answers if status == 200 and s > deadline_s)
    slowest_ok = max((s for status, s in answers if status == 200), default=0.0)
    worst = max(s for status, s in answers if status == 504) if 504 in statuses else 0.0
    spent = {
        reason: metric(after, "bertserve_unanswered_model_seconds_total", reason)
        - metric(before, "bertserve_unanswered_model_seconds_total", reason)
        for reason in ("expired", "cancelled")
    }
    dropped = metric(after, "bertserve_dropped_rows_total", "expired") - metric(
        before, "bertserve_dropped_rows_total", "expired"
    )
    queue = sorted(bulk)[len(bulk) // 2] if bulk else 0.0
    result = {
        "statuses": statuses,
        "late_200": late_ok,
        "slowest_200_s": slowest_ok,
        "slowest_504_s": worst,
        "unanswered_model_s": spent,
        "dropped_expired_rows": dropped,
        "indexer_p50_s": queue,
        "indexer_requests": len(bulk),
        "sent_s": sent_s,
    }
    print(json.dumps(result))
    table = [
        "| measure | value |",
        "|---|---|",
        f"| requests sent ({args.timeout_ms:g} ms timeout, priority 5, 16 at a time) | "
        f"{args.requests:,} in {sent_s:.1f} s |",
        "| answers by status | "
        + ", ".join(f"{k}: {v:,}" for k, v in sorted(statuses.items()))
        + " |",
        f"| answered 200 after their deadline (client's clock) | {late_ok} (the slowest 200: "
        f"{1000 * slowest_ok:.0f} ms) |",
        f"| slowest 504 (client's clock) | {1000 * worst:.0f} ms |",
        "| model time on expired sequences (`unanswered_model_seconds`) | "
        f"{spent['expired']:.3f} s |",
        f"| model time on sequences of clients gone | {spent['cancelled']:.3f} s |",
        f"| sequences dropped before compute, expired | {dropped:,.0f} |",
        f"| the indexer's 512-text requests meanwhile: median latency (the queue) | "
        f"{queue:.1f} s ({len(bulk)} answered) |",
    ]
    command = (
        f"bertserve bench deadlines --requests {args.requests} --timeout-ms {args.timeout_ms:g}"
    )
    text = "\n".join(
        [
            "# Deadlines: short timeouts into a queue seconds deep",
            "",
            f"{measured_with(command)}: one server of `{args.bundle.name}` (the service's "
            "defaults: a worker a core), an indexer of 4 connections sending 512-text /embed "
            "batches back to back, and single-text /embed requests with X-Request-Timeout-Ms: "
            f"{args.timeout_ms:g} and X-Request-Priority: 5 (below the indexer's 1, so they "
            "wait behind it unless their length puts them in its calls).",
            "",
            *table,
            "",
            "```json",
            json.dumps(result),
            "```",
            "",
            READING,
        ]
    )
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
