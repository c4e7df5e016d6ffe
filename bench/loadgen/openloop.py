"""Open-loop load: Poisson arrivals at a fixed rate, whatever the server's pace.

    python bench/loadgen/openloop.py --url http://127.0.0.1:8000/classify \
        --bodies runs/bench/inputs/classify.jsonl --rate 200 --seconds 10

Requests are pre-serialised HTTP/1.1 bytes written on raw asyncio sockets (no HTTP library: a
request costs the client a few tens of microseconds, and the run reports the CPU it used). Each
arrival takes an idle keep-alive connection or opens one, up to --max-connections; an arrival
that finds none free is counted as `unsent` rather than delayed, so the schedule never bends
to the server (no coordinated omission). Latency runs from the scheduled arrival to the last byte
of the answer. Prints one JSON line. With --ids-out, every request carries its own X-Request-ID
and the answered ones are written out, to be matched against the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import time
from urllib.parse import urlsplit

import numpy as np


def _requests(url: str, bodies_path: str) -> list[tuple[bytes, bytes]]:
    """(head without its blank line, body) of each request."""
    parts = urlsplit(url)
    out = []
    with open(bodies_path, "rb") as f:
        for line in f:
            body = line.strip()
            if body:
                head = (
                    f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                )
                out.append((head.encode(), body))
    return out


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, bool]:
    """Send one request, read its whole answer; returns (status, connection reusable)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, keep = 0, True
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "connection" and value.strip().lower() == "close":
            keep = False
    if length:
        await reader.readexactly(length)
    return status, keep


async def run(args: argparse.Namespace) -> dict:
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = _requests(args.url, args.bodies)
    rng = random.Random(args.seed)
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    open_count = 0
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    errors = unsent = sent = 0
    tasks: set[asyncio.Task] = set()
    answered: list[tuple[str, int]] = []  # (X-Request-ID, status), with --ids-out
    error_kinds: dict[str, int] = {}

    async def one(request: bytes, scheduled: float, request_id: str | None) -> None:
        nonlocal open_count, errors
        conn = idle.pop() if idle else None
        if conn is not None and conn[0].at_eof():  # the server closed it while it sat idle
            conn[1].close()
            conn = None
        try:
            if conn is None:
                conn = await asyncio.open_connection(host, port)
            status, keep = await asyncio.wait_for(_exchange(*conn, request), args.timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors += 1
            kind = type(exc).__name__
            error_kinds[kind] = error_kinds.get(kind, 0) + 1
            if conn is not None:
                conn[1].close()
            open_count -= 1
            return
        latencies.append(time.perf_counter() - scheduled)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if request_id is not None:
            answered.append((request_id, status))
        if keep:
            idle.append(conn)
        else:
            conn[1].close()
            open_count -= 1

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    at, i = start, 0
    while True:
        at += rng.expovariate(args.rate)
        if at - start >= args.seconds:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if not idle and open_count >= args.max_connections:
            unsent += 1
            continue
        if not idle:
            open_count += 1
        head, body = requests[i % len(requests)]
        request_id = f"openloop-{i}" if args.ids_out else None
        if request_id is not None:
            head += f"X-Request-ID: {request_id}\r\n".encode()
        task = asyncio.create_task(one(head + b"\r\n" + body, at, request_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        sent += 1
    offered_until = time.perf_counter()
    if tasks:
        await asyncio.wait(tasks, timeout=args.timeout + 5)
    elapsed = time.perf_counter() - start
    for _, writer in idle:
        writer.close()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if args.ids_out:
        with open(args.ids_out, "w") as f:
            f.writelines(f"{rid} {status}\n" for rid, status in answered)
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {
        "offered": args.rate,
        "sent": sent,
        "unsent": unsent,
        "responses": len(latencies),
        "statuses": statuses,
        "errors": errors,
        "error_kinds": error_kinds,
        "seconds": offered_until - start,
        "drain_seconds": elapsed - (offered_until - start),
        "p50_ms": float(np.percentile(lat, 50)),
        "p95_ms": float(np.percentile(lat, 95)),
        "p99_ms": float(np.percentile(lat, 99)),
        "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--bodies", required=True)
    parser.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--max-connections", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ids-out", help="tag each request with an X-Request-ID; write 'id status' per answer"
    )
    args = parser.parse_args()
    try:  # uvloop (the bench extra) halves the client's CPU per request
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
