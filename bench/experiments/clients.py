"""Clients as they come: an OpenAI-sized client batch and a framework's burst, against one
server of the shipped embedding and sentiment bundles, each beside its baseline in the same
minute.

- one request of 2,048 texts to /v1/embeddings against the same texts as 64 requests of 32 at
  8 connections: texts/s, rounds alternated;
- 200 concurrent /embed requests of 10 sentences (llama-index's TEI embedder sends an indexing
  job's batches at once): their statuses, and the latency of single /classify requests sent one
  after another during the burst against the same requests on the idle server.

    bertserve bench clients --data ../shared/data --report docs/reports/clients.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx

from bench.run import commit
from bench.servers import OURS, only_bundles, serve

EMBED, CLASSIFY = "minilm-embed", "sst2-distilled-2x192"


def sentences(data: Path, n: int) -> list[str]:
    """`n` SST-2 sentences (repeated if the split has fewer)."""
    rows = [line.split("\t")[0] for line in (data / "sst2" / "train.tsv").read_text().splitlines()]
    texts = [r for r in rows[1:] if r.strip()]
    return [texts[i % len(texts)] for i in range(n)]


async def one_big(client: httpx.AsyncClient, texts: list[str]) -> float:
    started = time.perf_counter()
    answer = await client.post("/v1/embeddings", json={"input": texts, "model": EMBED})
    assert answer.status_code == 200, answer.text[:200]
    return time.perf_counter() - started


async def many_small(client: httpx.AsyncClient, texts: list[str], size: int, conns: int) -> float:
    chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
    queue = list(reversed(chunks))

    async def worker() -> None:
        while queue:
            chunk = queue.pop()
            answer = await client.post("/v1/embeddings", json={"input": chunk, "model": EMBED})
            assert answer.status_code == 200, answer.text[:200]

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conns)))
    return time.perf_counter() - started


async def classify_latencies(client: httpx.AsyncClient, texts: list[str], until) -> list[float]:
    out = []
    for text in texts:
        if until():
            break
        started = time.perf_counter()
        answer = await client.post("/classify", json={"inputs": text})
        assert answer.status_code == 200, answer.text[:200]
        out.append(1000 * (time.perf_counter() - started))
    return out


async def run(base: str, data: Path, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        texts = sentences(data, 2048)
        await many_small(client, texts[:256], 32, 8)  # warm
        big: list[float] = []
        small: list[float] = []
        for i in range(rounds):
            pair = [
                ("big", lambda: one_big(client, texts)),
                ("small", lambda: many_small(client, texts, 32, 8)),
            ]
            for name, call in pair if i % 2 == 0 else pair[::-1]:
                (big if name == "big" else small).append(len(texts) / await call())
        probes = sentences(data, 4000)[2048:]
        idle = await classify_latencies(client, probes[:200], lambda: False)
        done = False

        async def burst() -> list[int]:
            nonlocal done
            bodies = [{"inputs": texts[10 * i : 10 * i + 10]} for i in range(200)]
            answers = await asyncio.gather(*(client.post("/embed", json=b) for b in bodies))
            done = True
            return [a.status_code for a in answers]

        started = time.perf_counter()
        statuses, during = await asyncio.gather(
            burst(), classify_latencies(client, probes[200:], lambda: done)
        )
        burst_s = time.perf_counter() - started
    return {
        "one_request_of_2048_texts_per_s": big,
        "64_requests_of_32_at_8_connections_texts_per_s": small,
        "ratio_median": statistics.median(big) / statistics.median(small),
        "burst": {
            "requests": len(statuses),
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "seconds": burst_s,
        },
        "classify_idle_p50_ms": statistics.median(idle),
        "classify_during_burst_p50_ms": statistics.median(during) if during else None,
        "classify_during_burst_max_ms": max(during) if during else None,
        "classify_during_burst_requests": len(during),
    }


def report(result: dict, rounds: int) -> str:
    """The run as docs/reports/clients.md: machine, date, commit, command, and each
    measurement beside its baseline."""
    big, small = (
        result["one_request_of_2048_texts_per_s"],
        result["64_requests_of_32_at_8_connections_texts_per_s"],
    )
    burst = result["burst"]
    during, idle = result["classify_during_burst_p50_ms"], result["classify_idle_p50_ms"]
    return "\n".join(
        [
            "# Clients as they come: a 2,048-text request and a burst of 200",
            "",
            f"Measured on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC at {commit()}, "
            f"{platform.machine()} with {os.cpu_count()} cores, with `bertserve bench clients "
            f"--rounds {rounds}`: one server of the shipped `{EMBED}` and `{CLASSIFY}` at its "
            "default settings (bench/experiments/clients.py), each measurement beside its "
            "baseline in the same minute.",
            "",
            "| | measured | baseline | ratio |",
            "|---|---|---|---|",
            f"| 2,048 texts in one /v1/embeddings request | "
            f"{' / '.join(f'{x:.0f}' for x in big)} texts/s | the same texts as 64 requests of "
            f"32 at 8 connections: {' / '.join(f'{x:.0f}' for x in small)} texts/s | "
            f"**{result['ratio_median']:.2f}x** (medians, rounds alternated) |",
            f"| 200 concurrent /embed requests of 10 sentences | statuses {burst['statuses']}, "
            f"in {burst['seconds']:.1f} s | | |",
            f"| single /classify sent one after another during that burst | p50 {during:.1f} ms "
            f"({result['classify_during_burst_requests']} answered, max "
            f"{result['classify_during_burst_max_ms']:.0f} ms) | the same requests on the idle "
            f"server: p50 {idle:.1f} ms | **{during / idle:.2f}x** |",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundles", type=Path, default=Path("bundles"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--work", type=Path, default=Path("runs/bench"))
    parser.add_argument("--report", type=Path, default=None, help="write the Markdown report")
    args = parser.parse_args()
    only = only_bundles(args.bundles, [EMBED, CLASSIFY], args.work / "clients-bundles")
    ready = json.dumps({"inputs": "ready"}).encode()
    with serve(
        OURS, only, only / EMBED, args.port, ready, args.work / "clients.log", ready_path="/embed"
    ) as server:
        result = asyncio.run(run(server.base, args.data, args.rounds))
    print(json.dumps(result, indent=2))
    if args.report:
        args.report.write_text(report(result, args.rounds))


if __name__ == "__main__":
    main()
