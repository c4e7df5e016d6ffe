"""The reliability suite: the service's promises under overload, faults and hostile input, each
with the figure it produced. Writes runs/bench/reliability.json and docs/reports/reliability.md.

    bertserve bench reliability [--overload-seconds 60]

Overload, SIGTERM and the hostile bodies run against a real `bertserve serve` process; the
injected faults (failing, stalled backend; clients that hang up) run against a real uvicorn
server in this process, so the engine can be wrapped. Load comes from wrk and
bench/loadgen/openloop.py, as in bench/run.py. Server memory is read from /proc (VmRSS and the
peak VmHWM).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.inputs import write_bodies
from bench.loadgen import closed_loop, open_loop
from bench.run import commit, log
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parent.parent
PORT = 8198


def memory_mib(pid: int) -> dict[str, float]:
    """Resident and peak-resident memory of process `pid` and its threads, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class MemorySampler:
    """RSS of a process every `every` seconds on a thread, for the peak and the curve."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every, self.samples = pid, every, list[float]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(memory_mib(self.pid)["VmRSS"])
            self._stop.wait(self.every)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --- against a real server process ----------------------------------------------------------


def overload(
    server, bodies: Path, seconds: float, preconnect: int = 0, rate: float | None = None
) -> dict:
    """5x the measured saturation (or `rate` requests/s), open loop, for `seconds`; then the
    recovery, second by second."""
    url = server.url("classify")
    closed_loop(url, bodies, 8, 2)
    saturation = closed_loop(url, bodies, 32, 5).throughput
    rate = rate or 5 * saturation
    log(f"  saturation {saturation:.0f} req/s; offering {rate:.0f} req/s for {seconds:.0f} s")
    before = memory_mib(server.proc.pid)
    with MemorySampler(server.proc.pid) as mem:
        flood = open_loop(
            url, bodies, rate, seconds, max_connections=2048, timeout_s=30, preconnect=preconnect
        )
    after = memory_mib(server.proc.pid)
    recovery = [closed_loop(url, bodies, 32, 1).throughput for _ in range(5)]
    log(
        f"  statuses {flood.statuses}, socket errors {flood.errors}, RSS {before['VmRSS']:.0f} -> "
        f"max {max(mem.samples):.0f} MiB; recovery {[round(x) for x in recovery]} req/s"
    )
    return {
        "saturation": saturation,
        "offered": rate,
        "sent": flood.extra["sent"],
        "unsent": flood.extra["unsent"],
        "seconds": seconds,
        "statuses": flood.statuses,
        "socket_errors": flood.errors,
        "socket_error_kinds": flood.extra["error_kinds"],
        "answered_200_per_s": flood.throughput,
        "p99_ms": flood.p99_ms,
        "max_ms": flood.extra["max_ms"],
        "over_1s": flood.extra["over_1s"],
        "late_by_second": flood.extra["late_by_second"],
        "late_parts_ms": flood.extra["late_parts_ms"],
        "by_status": flood.extra["by_status"],
        "client_cpu_pct": flood.client_cpu_pct,
        "rss_before_mib": before["VmRSS"],
        "rss_max_mib": max(mem.samples),
        "rss_after_mib": after["VmRSS"],
        "recovery_per_s": recovery,
    }


def raw_post(port: int, path: str, body: bytes, chunked: bool = False) -> dict:
    """POST `body` over a raw socket, 64 KiB at a time, and read the answer even when the server
    answers (and stops reading) before the body is sent: what a real client sees. With
    `chunked`, no Content-Length: the server can only find the size while the body streams."""
    started = time.perf_counter()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += (
        "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(body)}\r\n\r\n"
    )
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode())
        try:
            for i in range(0, len(body), 65536):
                piece = body[i : i + 65536]
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed early; its answer is still in our buffer
        answer = b""
        try:  # read the head, then exactly Content-Length bytes (the connection stays open)
            while b"\r\n\r\n" not in answer:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
            head_end = answer.find(b"\r\n\r\n") + 4
            length = 0
            for line in answer[:head_end].split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            while len(answer) < head_end + length:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    status_line, _, rest = answer.partition(b"\r\n")
    body_start = rest.find(b"\r\n\r\n")
    try:
        answer_json = json.loads(rest[body_start + 4 :]) if body_start >= 0 else None
        error = answer_json.get("error") if isinstance(answer_json, dict) else None
    except ValueError:
        error = None
    return {
        "status": int(status_line.split()[1]) if status_line else None,
        "error": error,
        "seconds": time.perf_counter() - started,
        "body_bytes": len(body),
        "bytes_sent": sent,
    }


def hostile_bodies(server) -> dict:
    """A 10 MB body (declared, and streamed without a length) and a 100,000-token text."""
    port = int(server.base.rsplit(":", 1)[1])
    pid = server.proc.pid
    out: dict[str, Any] = {}
    before = memory_mib(pid)
    big = b'{"inputs": "' + b"word " * (10 * 2**20 // 5) + b'"}'
    out["body_10mb"] = raw_post(port, "/classify", big)
    out["body_10mb_chunked"] = raw_post(port, "/classify", big, chunked=True)
    # "alpha beta gamma ..." is one token a word: 100,000 tokens, 500,000 characters.
    text = " ".join(random.Random(0).choice(["alpha", "beta", "gamma"]) for _ in range(100_000))
    for endpoint in ("classify", "ner"):
        result = raw_post(port, f"/{endpoint}", json.dumps({"inputs": text}).encode())
        out[f"text_100k_tokens_{endpoint}"] = result | {"chars": len(text)}
    # At the character limit: 100,000 CJK characters, one token each, pass the length check
    # and are tokenised; /classify refuses 100,000 tokens, /ner windows them.
    cjk = "".join(chr(0x4E00 + random.Random(1).randrange(2000)) for _ in range(100_000))
    for endpoint in ("classify", "ner"):
        result = raw_post(port, f"/{endpoint}", json.dumps({"inputs": cjk}).encode())
        out[f"cjk_100k_tokens_{endpoint}"] = result | {"chars": len(cjk)}
    after = memory_mib(pid)
    out["rss_before_mib"], out["rss_after_mib"] = before["VmRSS"], after["VmRSS"]
    out["peak_before_mib"], out["peak_after_mib"] = before["VmHWM"], after["VmHWM"]
    log(f"  {json.dumps(out)}")
    return out


def sigterm_under_load(bundles: Path, bundle: Path, bodies: Path, ready: bytes, logs: Path) -> dict:
    """SIGTERM under steady open-loop traffic, every request tagged with its own X-Request-ID:
    each request the server admitted (logged) was answered, and each answer reached its client."""
    log_file, ids_file = logs / "sigterm.log", logs / "sigterm-answered.txt"
    with serve(OURS, bundles, bundle, PORT + 1, ready, log_file) as server:
        url = server.url("classify")
        result: dict = {}

        def drive() -> None:
            result["load"] = open_loop(url, bodies, 300, 8, timeout_s=10, ids_out=ids_file)

        thread = threading.Thread(target=drive)
        thread.start()
        time.sleep(3)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        server.proc.wait(timeout=60)
        exit_s = time.monotonic() - signalled
        thread.join()
        exit_code = server.proc.returncode
    load = result["load"]
    logged: dict[str, int] = {}
    for line in log_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if str(record.get("request_id", "")).startswith("openloop-"):
            logged[record["request_id"]] = record["status"]
    answered = dict(line.split() for line in ids_file.read_text().splitlines())
    # A request the protocol refused while draining (503) was never admitted, so never logged.
    refused = {k for k, v in answered.items() if v == "503" and k not in logged}
    kinds = load.extra["error_kinds"]
    # Nothing listening (after the close): the client knows nothing was sent. Anything else
    # (reset, closed mid-answer, timeout) broke a connection that held a request.
    not_listening = kinds.get("connect:ConnectionRefusedError", 0)
    statuses: dict[str, int] = {}
    for status in logged.values():
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    out = {
        "sent": load.extra["sent"],
        "client_statuses": load.statuses,
        "client_socket_errors": load.errors,
        "server_logged": len(logged),
        "server_logged_statuses": statuses,
        "logged_not_received": sorted(set(logged) - set(answered)),
        "received_not_logged": sorted(set(answered) - set(logged) - refused),
        "refused_by_protocol": len(refused),
        "client_socket_error_kinds": kinds,
        "connections_refused": not_listening,
        "broken": load.errors - not_listening,
        "status_mismatch": sum(1 for k, v in answered.items() if str(logged.get(k, v)) != v),
        "exit_code": exit_code,
        "exit_s": exit_s,
    }
    log(f"  {json.dumps(out)[:600]}")
    return out


# --- injected faults, in this process ---------------------------------------------------------


class Faulty:
    """The real engine behind a fault: fail a share of calls, or stall every call for a while."""

    def __init__(self, engine, fail_rate: float = 0.0, stall_s: float = 0.0, seed: int = 0):
        self.engine, self.fail_rate, self.stall_s = engine, fail_rate, stall_s
        self.rng = random.Random(seed)
        self.calls = self.failed_calls = self.failed_rows = self.rows = 0
        self.lock = threading.Lock()

    def run(self, feeds):
        rows = len(feeds["input_ids"])
        with self.lock:
            self.calls += 1
            self.rows += rows
            fail = self.rng.random() < self.fail_rate
            if fail:
                self.failed_calls += 1
                self.failed_rows += rows
        if self.stall_s:
            time.sleep(self.stall_s)
        if fail:
            raise RuntimeError("injected backend failure")
        return self.engine.run(feeds)


def injected_faults(bundles: Path, bodies: Path, model: str) -> dict:
    from tests.helpers.server import live_server

    out = {}
    with live_server(bundles=bundles) as live:
        batcher = live.state.models[model].batcher
        engine = batcher.backend
        url = f"{live.url}/classify"

        log("  backend failing 5% of calls, 10 s at 16 connections")
        faulty = batcher.backend = Faulty(engine, fail_rate=0.05)
        run = closed_loop(url, bodies, 16, 10)
        batcher.backend = engine
        out["failing_backend"] = {
            "fail_rate": 0.05,
            "calls": faulty.calls,
            "failed_calls": faulty.failed_calls,
            "failed_rows": faulty.failed_rows,
            "statuses": run.statuses,
            "socket_errors": run.errors,
            # wrk stops with up to 16 requests in flight: their rows may be counted on one side
            "only_failed_batches_failed": abs(run.statuses.get("500", 0) - faulty.failed_rows)
            <= 16,
        }
        log(f"    {out['failing_backend']}")

        log("  100 clients hang up while their requests wait behind a slow batch")
        slow = batcher.backend = Faulty(engine, stall_s=0.5)
        dropped_before = _dropped(live.url, model)
        body = bodies.read_text().splitlines()[0].encode()
        head = (
            f"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        port = live.server.config.port
        keeper = socket.create_connection(("127.0.0.1", port))
        keeper.sendall(head + body)  # occupies the model for 0.5 s
        time.sleep(0.1)
        calls_before, rows_before = slow.calls, slow.rows
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(head + body)
        keeper.recv(65536)
        keeper.close()
        time.sleep(1.5)
        out["client_disconnects"] = {
            "hung_up": 100,
            "rows_computed_after": slow.rows - rows_before,
            "model_calls_after": slow.calls - calls_before,
            "dropped_cancelled": _dropped(live.url, model) - dropped_before,
        }
        batcher.backend = engine
        log(f"    {out['client_disconnects']}")

    log("  backend stalled 3 s a call, deadline 1 s, queue limit 64, 128 connections")
    with live_server(bundles=bundles, request_timeout_s=1.0, max_queue_rows=64) as live:
        batcher = live.state.models[model].batcher
        engine = batcher.backend
        url = f"{live.url}/classify"
        batcher.backend = Faulty(engine, stall_s=3.0)
        depths: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                depths.append(batcher.depth)
                stop.wait(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        stalled = closed_loop(url, bodies, 128, 8, timeout_s=10)
        stop.set()
        watcher.join()
        batcher.backend = engine
        time.sleep(3.5)  # the last stalled call finishes
        after = closed_loop(url, bodies, 8, 3)
        out["stalled_backend"] = {
            "statuses": stalled.statuses,
            "socket_errors": stalled.errors,
            "max_queue_rows": 64,
            "max_depth_seen": max(depths),
            "after_statuses": after.statuses,
            "after_per_s": after.throughput,
        }
        log(f"    {out['stalled_backend']}")
    return out


def _dropped(base: str, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics") as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "bertserve_dropped_rows_total"
                and sample.labels.get("model") == model
                and sample.labels.get("reason") == "cancelled"
            ):
                return sample.value
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--classify-bundle", default="sst2-distilled-2x192")
    parser.add_argument("--ner-bundle", default="conll-distilled-3x192", help="for /ner bodies")
    parser.add_argument("--overload-seconds", type=float, default=60)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "reports" / "reliability.md")
    args = parser.parse_args()
    import logging

    # The in-process server's logs (one traceback per injected failure) go to a file.
    args.work.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=args.work / "reliability-inprocess.log", level=logging.INFO, force=True
    )
    started = time.time()
    bodies = write_bodies("classify", args.data, args.work / "inputs")
    ready = bodies.read_text().splitlines()[0].encode()
    # The NER bundle is for the hostile bodies.
    names = [args.classify_bundle, args.ner_bundle]
    args.bundles = only_bundles(args.bundles, names, args.work / "bundles")
    bundle = args.bundles / args.classify_bundle
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "bundles": f"--classify-bundle {args.classify_bundle} --ner-bundle {args.ner_bundle}",
    }

    log("overload and hostile bodies (real server process)")
    with serve(OURS, args.bundles, bundle, PORT, ready, args.work / "overload.log") as server:
        results["overload"] = overload(server, bodies, args.overload_seconds)
        results["hostile"] = hostile_bodies(server)
    log("SIGTERM under load (real server process)")
    results["sigterm"] = sigterm_under_load(args.bundles, bundle, bodies, ready, args.work)
    log("injected faults (in-process server, wrapped engine)")
    results.update(injected_faults(args.bundles, bodies, args.classify_bundle))
    results["wall_s"] = time.time() - started
    (args.work / "reliability.json").write_text(json.dumps(results, indent=2))
    from bench.reliability_report import write_report

    write_report(results, args.report)
    log(f"wrote {args.report} in {results['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
