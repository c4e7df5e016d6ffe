"""Load generation on loopback: closed loop with wrk (C, scripted in Lua) and open loop with
Poisson arrivals from `openloop.py` (raw asyncio sockets, no HTTP library). Both report the
client's own CPU so a reader can see the client is not what was measured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LUA = HERE / "replay.lua"


@dataclass
class LoadResult:
    mode: str  # "closed" (concurrency) or "open" (Poisson rate)
    level: float  # connections, or offered requests/s
    requests: int  # responses received
    seconds: float
    statuses: dict[str, int]
    errors: int  # socket errors and timeouts, not HTTP statuses
    p50_ms: float
    p95_ms: float
    p99_ms: float
    client_cpu_s: float
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return self.statuses.get("200", 0)

    @property
    def throughput(self) -> float:
        """Successful responses per second."""
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def client_cpu_pct(self) -> float:
        """The client's CPU time as a share of one core over the run."""
        return 100 * self.client_cpu_s / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "throughput": self.throughput,
            "client_cpu_pct": self.client_cpu_pct,
        }


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """Run `cmd` to the end and return its stdout. Its CPU time is then in RUSAGE_CHILDREN,
    which only grows: callers measure it as a difference around the call."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return out.decode()


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def closed_loop(
    url: str, bodies: Path, connections: int, seconds: float, timeout_s: float = 30
) -> LoadResult:
    """`connections` keep-alive connections, each sending its next body as soon as the previous
    answer arrives (wrk, one thread: one core of wrk drives well over 50k requests/s)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed: apt-get install wrk")
    cmd = [
        wrk,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",  # wrk takes whole seconds
        f"--timeout={timeout_s:g}s",
        "-s",
        str(LUA),
        url,
    ]
    before = _children_cpu()
    out = _run(cmd, os.environ | {"WRK_BODIES": str(bodies)}, timeout=seconds + timeout_s + 30)
    cpu = _children_cpu() - before
    line = next(x for x in out.splitlines() if x.startswith("WRK_JSON "))
    raw = json.loads(line[len("WRK_JSON ") :])
    e = raw["errors"]
    lat = raw["latency_us"]
    return LoadResult(
        mode="closed",
        level=connections,
        requests=sum(raw["statuses"].values()),
        seconds=raw["duration_us"] / 1e6,
        statuses={str(k): v for k, v in raw["statuses"].items()},
        errors=e["connect"] + e["read"] + e["write"] + e["timeout"],
        p50_ms=lat["p50"] / 1000,
        p95_ms=lat["p95"] / 1000,
        p99_ms=lat["p99"] / 1000,
        client_cpu_s=cpu,
        extra={"mean_ms": lat["mean"] / 1000, "max_ms": lat["max"] / 1000},
    )


def open_loop(
    url: str,
    bodies: Path,
    rate: float,
    seconds: float,
    max_connections: int = 1024,
    timeout_s: float = 30,
    seed: int = 0,
    ids_out: Path | None = None,
    preconnect: int = 0,
    headers: dict[str, str] | None = None,
) -> LoadResult:
    """Poisson arrivals at `rate` requests/s for `seconds`, whatever the server's pace. Latency is
    measured from each request's scheduled arrival, so a slow server cannot slow the clock."""
    cmd = [
        sys.executable,
        str(HERE / "openloop.py"),
        "--url",
        url,
        "--bodies",
        str(bodies),
        "--rate",
        str(rate),
        "--seconds",
        str(seconds),
        "--max-connections",
        str(max_connections),
        "--timeout",
        str(timeout_s),
        "--seed",
        str(seed),
        "--preconnect",
        str(preconnect),
        *(["--ids-out", str(ids_out)] if ids_out else []),
        *[
            arg
            for name, value in (headers or {}).items()
            for arg in ("--header", f"{name}: {value}")
        ],
    ]
    before = _children_cpu()
    out = _run(cmd, dict(os.environ), timeout=seconds + timeout_s + 60)
    cpu = _children_cpu() - before
    raw = json.loads(out.strip().splitlines()[-1])
    return LoadResult(
        mode="open",
        level=rate,
        requests=raw["responses"],
        seconds=raw["seconds"],
        statuses=raw["statuses"],
        errors=raw["errors"],
        p50_ms=raw["p50_ms"],
        p95_ms=raw["p95_ms"],
        p99_ms=raw["p99_ms"],
        client_cpu_s=cpu,
        extra={
            "sent": raw["sent"],
            "unsent": raw["unsent"],
            "offered": raw["offered"],
            "error_kinds": raw["error_kinds"],
            "max_ms": raw["max_ms"],
            "over_1s": raw["over_1s"],
            "late_by_second": raw["late_by_second"],
            "late_parts_ms": raw["late_parts_ms"],
            "by_status": raw["by_status"],
        },
    )


def wait_ready(
    url: str,
    body: bytes,
    timeout: float = 180,
    proc: subprocess.Popen | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """POST `body` to `url` until it answers 200: the server has loaded and answers for real."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        request = urllib.request.Request(
            url,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
