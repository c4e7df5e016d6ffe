"""A steady keyed load for `make cluster-test`, run as a pod inside the cluster (the bertserve
image's Python, standard library only): CONCURRENCY clients, each sending one POST after
another on a keep-alive connection to the Service's address, for DURATION seconds.

One JSON line per request on stdout: [start (epoch s), milliseconds, outcome, reused]
- outcome: the HTTP status, "conn" (the connection failed or closed before a whole response),
  "timeout" (no whole response in TIMEOUT seconds), or "error:NAME" (anything else);
- reused: the request went out on a connection an earlier request had used.
A 503 counts as a refusal only with Retry-After; its line's outcome is then "503ra".
Environment: TARGET (host:port), PATH_ (the route), BODY (JSON), API_KEY, CONCURRENCY,
DURATION, TIMEOUT, RECYCLE (a client opens a new connection after this many requests, as
connection pools recycle theirs; 0: never). It stops at DURATION or when /tmp/stop exists
(`kubectl exec POD -- touch /tmp/stop`), and prints {"done": true} last.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

TARGET = os.environ["TARGET"]
ROUTE = os.environ.get("PATH_", "/classify")
BODY = os.environ.get("BODY", '{"inputs": "a charming and often affecting journey"}').encode()
KEY = os.environ.get("API_KEY", "")
CONCURRENCY = int(os.environ.get("CONCURRENCY", "4"))
DURATION = float(os.environ.get("DURATION", "60"))
TIMEOUT = float(os.environ.get("TIMEOUT", "30"))
RECYCLE = int(os.environ.get("RECYCLE", "0"))
STOP = "/tmp/stop"
HOST, PORT = TARGET.rsplit(":", 1)

REQUEST = (
    f"POST {ROUTE} HTTP/1.1\r\nHost: {TARGET}\r\nContent-Type: application/json\r\n"
    f"Authorization: Bearer {KEY}\r\nContent-Length: {len(BODY)}\r\n\r\n"
).encode() + BODY


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[int, dict[str, str]]:
    writer.write(REQUEST)
    await writer.drain()
    status_line = await reader.readuntil(b"\r\n")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers


def stopped(deadline: float) -> bool:
    return time.time() >= deadline or os.path.exists(STOP)


async def client(deadline: float, out: list[str]) -> None:
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    used = False
    sent = 0
    while not stopped(deadline):
        start = time.time()
        reused = used
        outcome: int | str
        try:
            if conn is None:
                conn = await asyncio.wait_for(asyncio.open_connection(HOST, int(PORT)), TIMEOUT)
                used, reused, sent = False, False, 0
            status, headers = await asyncio.wait_for(exchange(*conn), TIMEOUT)
            used = True
            sent += 1
            outcome = "503ra" if status == 503 and "retry-after" in headers else status
            if headers.get("connection", "").lower() == "close" or sent == RECYCLE:
                conn[1].close()
                conn = None
        except TimeoutError:
            outcome = "timeout"
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            outcome = "conn"
        except Exception as e:  # anything else is still a request, and a failed one
            outcome = f"error:{type(e).__name__}"
        if not isinstance(outcome, int) and outcome != "503ra" and conn is not None:
            conn[1].close()
            conn = None
        ms = (time.time() - start) * 1000
        out.append(json.dumps([round(start, 4), round(ms, 2), outcome, reused]))
        if outcome in ("conn", "503ra"):
            await asyncio.sleep(0.05)  # a refused client backs off a little, as Retry-After asks


async def main() -> None:
    out: list[str] = []
    deadline = time.time() + DURATION
    tasks = [asyncio.ensure_future(client(deadline, out)) for _ in range(CONCURRENCY)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.5)
        if out:
            sys.stdout.write("\n".join(out) + "\n")
            sys.stdout.flush()
            out.clear()
    if out:
        sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.write(json.dumps({"done": True}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
