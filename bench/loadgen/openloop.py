"""Open-loop load: Poisson arrivals at a fixed rate, whatever the server's pace.

    python bench/loadgen/openloop.py --url http://127.0.0.1:8000/classify \
        --bodies runs/bench/inputs/classify.jsonl --rate 200 --seconds 10

Requests are pre-serialised HTTP/1.1 bytes written by an asyncio Protocol (no HTTP library, no
stream objects or tasks per request: a request costs the client ~10-20 us with uvloop, so it
can offer several times what the server on the same cores can answer; the run reports the CPU
it used). Each
arrival takes an idle keep-alive connection or opens one, up to --max-connections; an arrival
that finds none free is counted as `unsent` rather than delayed, so the schedule never bends
to the server (no coordinated omission). Latency runs from the scheduled arrival to the last byte
of the answer. Prints one JSON line. With --ids-out, every request carries its own X-Request-ID
and the answered ones are written out, to be matched against the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import random
import resource
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import numpy as np


def _requests(
    url: str, bodies_path: str, headers: tuple[str, ...] = ()
) -> list[tuple[bytes, bytes]]:
    """(head without its blank line, body) of each request; `headers`: "Name: value" lines
    every request carries (an Authorization, a priority)."""
    parts = urlsplit(url)
    extra = "".join(f"{line}\r\n" for line in headers)
    out = []
    with open(bodies_path, "rb") as f:
        for line in f:
            body = line.strip()
            if body:
                head = (
                    f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
                )
                out.append((head.encode(), body))
    return out


def _parts(late: list[tuple[float, float, float]]) -> dict:
    """p50 / max (ms) of each part of the late answers' time, and how many were on a connection
    opened for them."""
    if not late:
        return {"n": 0}
    parts = np.array(late) * 1000
    out: dict = {"n": len(late), "on_new_connections": int((parts[:, 1] > 0).sum())}
    for i, name in enumerate(("client_lag", "connect", "exchange")):
        out[name] = [
            round(float(np.percentile(parts[:, i], 50)), 1),
            round(float(parts[:, i].max()), 1),
        ]
    return out


def _idle_bucket(seconds: float) -> str:
    """A coarse label for how long a connection sat idle before its failed reuse."""
    for bound in (0.1, 1, 4.5, 5.5, 30):
        if seconds < bound:
            return f"idle-under-{bound:g}s"
    return "idle-30s-or-more"


class _Connection(asyncio.Protocol):
    """One keep-alive client connection: a request written, its answer parsed from the bytes as
    they arrive (status line, Content-Length, Connection), no stream objects or tasks per
    request, so the client's CPU goes to the server's load rather than to itself."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.done: Callable[[int | None, bool, BaseException | None], None] | None = None
        self.lost = False
        self.idle_since: float | None = None  # when its last answer ended (None: never used)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, done: Callable[[int | None, bool, BaseException | None], None]):
        self.done = done
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.done is None:
            return
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        length, keep = 0, True
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                keep = False
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[: end + 4 + length]
        done, self.done = self.done, None
        done(int(lines[0].split(" ", 2)[1]), keep, None)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        if self.done is not None:
            done, self.done = self.done, None
            done(None, False, exc or asyncio.IncompleteReadError(bytes(self.buffer), None))

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


async def run(args: argparse.Namespace) -> dict:
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = _requests(args.url, args.bodies, tuple(args.header))
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    idle: list[_Connection] = []
    open_count = 0
    latencies: dict[int, list[float]] = {}  # by status: seconds from scheduled to answered
    errors = unsent = sent = 0
    outstanding = 0
    answered: list[tuple[str, int]] = []  # (X-Request-ID, status), with --ids-out
    error_kinds: dict[str, int] = {}
    late_by_second: dict[int, int] = {}  # answers over 1 s, by the second they were scheduled in
    # Where each late answer's time went: (client lag, connect, exchange) in seconds. The client
    # lag runs from the scheduled arrival to the moment this client began the request (its own
    # loop behind schedule), connect is the TCP connect of a fresh connection as this client's
    # loop saw it, exchange from the request's write to its answer's last byte.
    late_parts: list[tuple[float, float, float]] = []
    finished = asyncio.Event()

    def settle() -> None:
        nonlocal outstanding
        outstanding -= 1
        if outstanding == 0 and finished_sending:
            finished.set()

    def failed(phase: str, exc: BaseException, idle_for: float | None = None) -> None:
        # "connect:ConnectionRefusedError": nothing listened (never admitted, safe to retry
        # elsewhere); "exchange:...": the connection broke or timed out with the request on it,
        # on a fresh connection or on one reused after sitting idle (how long says whose timer
        # closed it: a server's keep-alive timeout racing the reuse, or something else).
        nonlocal errors
        errors += 1
        kind = f"{phase}:{type(exc).__name__}"
        if type(exc) is OSError and exc.errno:
            kind += f":{errno.errorcode.get(exc.errno, exc.errno)}"
        if phase == "exchange":
            kind += ":fresh" if idle_for is None else f":reused-after-{_idle_bucket(idle_for)}"
        error_kinds[kind] = error_kinds.get(kind, 0) + 1

    def exchange(
        conn: _Connection,
        request: bytes,
        scheduled: float,
        rid: str | None,
        began: float | None = None,
        connect_s: float = 0.0,
    ) -> None:
        written = time.perf_counter()
        began = written if began is None else began
        idle_for = None if conn.idle_since is None else written - conn.idle_since

        def done(status: int | None, keep: bool, exc: BaseException | None) -> None:
            nonlocal open_count
            timer.cancel()
            if status is None:
                failed("exchange", exc or TimeoutError(), idle_for)
                conn.close()
                open_count -= 1
            else:
                answered_at = time.perf_counter()
                latency = answered_at - scheduled
                latencies.setdefault(status, []).append(latency)
                if latency > 1:  # when in the run the late ones were sent: a ramp, or steady
                    second = int(scheduled - start)
                    late_by_second[second] = late_by_second.get(second, 0) + 1
                    # (the sleep to an arrival can end a fraction of a millisecond early)
                    lag = max(0.0, began - scheduled)
                    late_parts.append((lag, connect_s, answered_at - written))
                if rid is not None:
                    answered.append((rid, status))
                if keep and not conn.lost:
                    conn.idle_since = time.perf_counter()
                    idle.append(conn)
                else:
                    conn.close()
                    open_count -= 1
            settle()

        def timed_out() -> None:
            if conn.done is done:
                conn.done = None
                done(None, False, TimeoutError())

        timer = loop.call_later(args.timeout, timed_out)
        conn.send(request, done)

    async def connect_then(request: bytes, scheduled: float, rid: str | None) -> None:
        nonlocal open_count
        began = time.perf_counter()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, host, port), args.timeout
            )
        except (TimeoutError, OSError) as exc:
            failed("connect", exc)
            open_count -= 1
            settle()
            return
        exchange(conn, request, scheduled, rid, began, time.perf_counter() - began)

    # Connections opened before the schedule starts: the flood without its opening storm of
    # connects (the late answers of a run's first second are that storm's).
    for opened in await asyncio.gather(
        *(loop.create_connection(_Connection, host, port) for _ in range(args.preconnect)),
        return_exceptions=True,
    ):
        if isinstance(opened, BaseException):
            failed("connect", opened)
        else:
            idle.append(opened[1])
            open_count += 1
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    finished_sending = False
    tasks: set[asyncio.Task] = set()
    start = time.perf_counter()
    at, i = start, 0
    while True:
        at += rng.expovariate(args.rate)
        if at - start >= args.seconds:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        conn = None
        while idle and conn is None:
            conn = idle.pop()
            if conn.lost:  # the server closed it while it sat idle
                conn, open_count = None, open_count - 1
        if conn is None and open_count >= args.max_connections:
            unsent += 1
            continue
        head, body = requests[i % len(requests)]
        rid = f"openloop-{i}" if args.ids_out else None
        if rid is not None:
            head += f"X-Request-ID: {rid}\r\n".encode()
        request = head + b"\r\n" + body
        outstanding += 1
        if conn is not None:
            exchange(conn, request, at, rid)
        else:
            open_count += 1
            task = loop.create_task(connect_then(request, at, rid))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        i += 1
        sent += 1
    offered_until = time.perf_counter()
    finished_sending = True
    if outstanding:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), args.timeout + 5)
    elapsed = time.perf_counter() - start
    for conn in idle:
        conn.close()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if args.ids_out:
        with open(args.ids_out, "w") as f:
            f.writelines(f"{rid} {status}\n" for rid, status in answered)
    every = [x for v in latencies.values() for x in v]
    lat = np.array(every) * 1000 if every else np.zeros(1)
    return {
        "offered": args.rate,
        "sent": sent,
        "unsent": unsent,
        "responses": len(every),
        "statuses": {str(k): len(v) for k, v in latencies.items()},
        "errors": errors,
        "error_kinds": error_kinds,
        "seconds": offered_until - start,
        "drain_seconds": elapsed - (offered_until - start),
        "p50_ms": float(np.percentile(lat, 50)),
        "p95_ms": float(np.percentile(lat, 95)),
        "p99_ms": float(np.percentile(lat, 99)),
        "max_ms": float(lat.max()),
        "over_1s": int((lat > 1000).sum()) if every else 0,
        "by_status": {
            str(k): {
                "p50_ms": float(np.percentile(v, 50) * 1000),
                "p99_ms": float(np.percentile(v, 99) * 1000),
                "max_ms": float(max(v) * 1000),
                "over_1s": sum(1 for x in v if x > 1),
            }
            for k, v in sorted(latencies.items())
        },
        "late_by_second": dict(sorted(late_by_second.items())),
        "late_parts_ms": _parts(late_parts),
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
        "--preconnect", type=int, default=0, help="connections to open before the schedule starts"
    )
    parser.add_argument(
        "--header", action="append", default=[], help="'Name: value' on every request"
    )
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
