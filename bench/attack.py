"""The adversarial review's targets, measured against `bertserve serve` on the shipped bundles
with an API key set (one worker, so its memory is the process's):

1. each repro of the review: status, time, and the worker's resident growth it leaves;
2. two clients sending the most expensive allowed request of each endpoint, while a prober
   times /health/live and a keyed client times small /classify requests (against their idle
   p50 measured first);
3. 500 unauthenticated connections misbehaving (bodiless GETs that declare a body, idle
   keep-alive, slow and oversized headers) while a keyed client counts its non-200 answers;
4. 10,000 mixed requests, the largest allowed ones included: resident memory against warm.

    bertserve bench attack [--tree DIR] [--report docs/reports/security-bench.md]

`--tree` serves another source tree (a worktree of an older commit) for an A/B.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bertserve.service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
KEY = "bench-attack-key-0123456789abcdef"
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
CONTEXT = "The king of France was born in Paris and lived there for many years . "


Request = tuple[str, dict[str, Any]]  # (path, body)


def repros() -> dict[str, Request]:
    """The review's findings as requests (name -> path, body)."""
    return {
        "/nsp 16 kB pair, truncation": (
            "/nsp",
            {
                "inputs": {"text": "a." * 4000, "text_pair": "a." * 4000},
                "parameters": {"truncation": True},
            },
        ),
        "/nsp 200 kB pair, truncation": (
            "/nsp",
            {
                "inputs": {"text": "a." * 50_000, "text_pair": "a." * 50_000},
                "parameters": {"truncation": True},
            },
        ),
        "/qa 4 kB, max_seq_len 58, stride 27, top_k 100": (
            "/qa",
            {
                "inputs": {"question": "where was the king born?", "context": CONTEXT * 57},
                "parameters": {"max_seq_len": 58, "doc_stride": 27, "top_k": 100},
            },
        ),
        "/qa 18 kB, top_k 100, max_answer_len 512": (
            "/qa",
            {
                "inputs": {"question": "where was the king born?", "context": CONTEXT * 250},
                "parameters": {"top_k": 100, "max_answer_len": 512},
            },
        ),
        "/fill-mask 1,000 targets": (
            "/fill-mask",
            {
                "inputs": "paris is the [MASK] of france.",
                "parameters": {"targets": [f"word{i}" for i in range(1000)]},
            },
        ),
        "/ner 190k ignore_labels": (
            "/ner",
            {
                "inputs": "Angela Merkel met Emmanuel Macron in Paris.",
                "parameters": {"aggregation_strategy": "none", "ignore_labels": ["X"] * 190_000},
            },
        ),
        "/ner 9 x 100 kB": ("/ner", {"inputs": ["a." * 49_999] * 9}),
    }


def heaviest() -> list[Request]:
    """The most expensive request each endpoint allows (at the default limits): a client batch
    of as many inputs as the body limit and the batch limit let through."""
    limits = Settings()
    body, batch = limits.max_body_bytes * 9 // 10, limits.max_client_batch
    masks = "the [MASK] of the [MASK] was [MASK] in the [MASK] of [MASK] . " * 2
    long_text = "a." * 40_000
    passage = CONTEXT * 6  # about the model's 256 tokens
    return [
        ("/qa", repros()["/qa 18 kB, top_k 100, max_answer_len 512"][1]),
        ("/fill-mask", {"inputs": masks, "parameters": {"top_k": 100}}),
        ("/ner", {"inputs": [CONTEXT * 80] * 2}),
        ("/nsp", repros()["/nsp 200 kB pair, truncation"][1]),
        (
            "/classify",
            {
                "inputs": [long_text] * min(batch, body // len(long_text)),
                "parameters": {"truncation": True},
            },
        ),
        ("/embed", {"inputs": [passage] * min(batch, body // len(passage))}),
    ]


def rss_mb(pid: int) -> float:
    return (
        int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: Path, port: int, log: Path) -> subprocess.Popen:
    env = os.environ | {
        "BERTSERVE_API_KEYS": KEY,
        "BERTSERVE_WORKERS": os.environ.get("ATTACK_WORKERS", "1"),
        "BERTSERVE_LOG_LEVEL": "warning",
    }
    command = [sys.executable, "-m", "bertserve.service", "--bundles", str(ROOT / "bundles")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command, "--port", str(port)], cwd=tree, env=env, stdout=out, stderr=out
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the service never became ready")


def post(c: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, float]:
    data = json.dumps(body).encode()
    started = time.perf_counter()
    try:
        status = c.post(path, content=data).status_code
    except httpx.TransportError:
        status = 0
    return status, time.perf_counter() - started


def small_p50(c: httpx.Client, seconds: float) -> tuple[float, int]:
    """p50 of small keyed /classify requests for `seconds`, and how many were not 200."""
    times, bad = [], 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        status, elapsed = post(c, "/classify", {"inputs": "a charming and often affecting journey"})
        times.append(elapsed)
        bad += status != 200
        time.sleep(0.01)
    return 1000 * statistics.median(times), bad


def probe_live(base: str, seconds: float, out: Any) -> None:
    """/health/live every 10 ms on a fresh connection each (as kubelet probes), over a raw
    socket (an httpx client built a probe costs ~35 ms of its own): the latencies. A process
    of its own, so the load's client threads do not share its GIL."""
    host, port = base.removeprefix("http://").split(":")
    request = b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    times = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.perf_counter()
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 5) as s:
            s.sendall(request)
            while s.recv(65536):
                pass
        times.append(time.perf_counter() - started)
        time.sleep(0.01)
    out.put(times)


def time_small(base: str, seconds: float, out: Any) -> None:
    """`small_p50` in a process of its own."""
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
        out.put(small_p50(c, seconds))


def heaviest_qa() -> list[Request]:
    """The two costliest /qa requests the default limits allow: many windows, and many
    candidates a window."""
    found = repros()
    return [
        found["/qa 4 kB, max_seq_len 58, stride 27, top_k 100"],
        found["/qa 18 kB, top_k 100, max_answer_len 512"],
    ]


def send_heavy(
    base: str, offset: int, seconds: float, out: Any, requests: list[Request] | None = None
) -> None:
    """Cycle through `requests` (default `heaviest()`; bodies encoded once) for `seconds`: the
    statuses by path."""
    bodies = [(path, json.dumps(body).encode()) for path, body in requests or heaviest()]
    served: dict[str, list[int]] = {}
    until = time.monotonic() + seconds
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
        i = offset
        while time.monotonic() < until:
            path, data = bodies[i % len(bodies)]
            try:
                status = c.post(path, content=data).status_code
            except httpx.TransportError:
                status = 0
            served.setdefault(path, []).append(status)
            i += 1
    out.put(served)


def expensive_clients(
    base: str, seconds: float, heavy: list[Request] | None = None, clients: int = 2
) -> dict[str, Any]:
    """Phase 2: `clients` clients cycling through the heaviest requests (`heavy`, default
    every endpoint's) while a prober times /health/live and a keyed client times small
    requests, each a process of its own. Phase 6: one client, the heaviest /qa only."""
    spawn = multiprocessing.get_context("spawn")
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
        idle, _ = small_p50(c, 5)
    queues = [spawn.Queue() for _ in range(clients + 2)]
    processes = [
        spawn.Process(target=send_heavy, args=(base, 3 * i, seconds + 2, queues[i], heavy))
        for i in range(clients)
    ]
    processes += [
        spawn.Process(target=probe_live, args=(base, seconds, queues[clients])),
        spawn.Process(target=time_small, args=(base, seconds, queues[clients + 1])),
    ]
    for p in processes[:clients]:
        p.start()
    time.sleep(2)  # the heavy clients under way first
    for p in processes[clients:]:
        p.start()
    results = [q.get() for q in queues]
    for p in processes:
        p.join()
    served = {k: v for part in results[:clients] for k, v in part.items()}
    probes, (loaded, bad) = results[clients], results[clients + 1]
    return {
        "idle_p50_ms": idle,
        "loaded_p50_ms": loaded,
        "small_not_200": bad,
        "live_max_ms": 1000 * max(probes),
        "live_p99_ms": 1000 * sorted(probes)[int(0.99 * (len(probes) - 1))],
        "heavy_statuses": {p: sorted(set(s)) for p, s in served.items()},
        "heavy_requests": sum(len(s) for part in results[:clients] for s in part.values()),
    }


def trailer_flood(host: str, port: int, until: float) -> int:
    """One attacker of phase 7: a chunked /classify without a key whose trailer never ends,
    sent 64 kB at a time, again on a new connection each time the server closes one, until
    `until`. The connections it made."""
    opened = 0
    while time.monotonic() < until:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 5) as s:
            opened += 1
            s.sendall(
                b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"2\r\n{}\r\n0\r\nX-Pad: "
            )
            while time.monotonic() < until:
                s.sendall(b"a" * 65536)
    return opened


def trailers(base: str, pids: list[int], count: int, seconds: float) -> dict[str, Any]:
    """Phase 7: `count` trailer floods for `seconds` while a keyed client times small
    /classify requests and a prober /health/live; each worker's resident growth."""
    host, port = base.removeprefix("http://").split(":")
    before = {pid: rss_mb(pid) for pid in pids}
    until = time.monotonic() + seconds
    opened: list[int] = []
    attackers = [
        threading.Thread(target=lambda: opened.append(trailer_flood(host, int(port), until)))
        for _ in range(count)
    ]
    for t in attackers:
        t.start()
    spawn = multiprocessing.get_context("spawn")
    probes = spawn.Queue()
    prober = spawn.Process(target=probe_live, args=(base, seconds - 1, probes))
    prober.start()
    times: list[float] = []
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=base, headers=AUTH, timeout=30) as c:
        while time.monotonic() < until:
            status, elapsed = post(c, "/classify", {"inputs": "fine"})
            statuses[status] = statuses.get(status, 0) + 1
            times.append(elapsed)
            time.sleep(0.05)
    live = probes.get()
    prober.join()
    for t in attackers:
        t.join()
    return {
        "connections_made": sum(opened),
        "classify_statuses": statuses,
        "classify_max_ms": 1000 * max(times),
        "live_max_ms": 1000 * max(live),
        "growth_mb": {pid: rss_mb(pid) - mb for pid, mb in before.items()},
    }


def worker_pids(supervisor: int) -> list[int]:
    """The serving processes: the supervisor's children that run the service (or itself)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    found = [
        int(pid)
        for pid in children
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    return found or [supervisor]


def misbehave(base: str, count: int, seconds: float) -> dict[str, Any]:
    """Phase 3: `count` unauthenticated connections in four ways at once, held open."""
    host, port = base.removeprefix("http://").split(":")
    heads = [
        b"GET /health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",  # no body
        b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n",  # then idle, kept alive
        b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-",  # slow headers
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000,  # oversized header
    ]
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            for i in range(count - len(held)):
                try:
                    s = socket.create_connection((host, int(port)), timeout=2)
                    s.setblocking(False)
                    s.sendall(heads[i % len(heads)])
                    held.append(s)
                except OSError:
                    pass
            time.sleep(0.2)
            for s in list(held):  # closed by the server: open another
                try:
                    if s.recv(65536) == b"":
                        held.remove(s)
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    held.remove(s)
                    s.close()

    attacker = threading.Thread(target=hold, daemon=True)
    attacker.start()
    time.sleep(1.0)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=base, headers=AUTH, timeout=10) as c:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            status, _ = post(c, "/classify", {"inputs": "fine"})
            statuses[status] = statuses.get(status, 0) + 1
            time.sleep(0.005)
    stop.set()
    attacker.join()
    for s in held:
        s.close()
    return {"keyed": statuses, "attackers": count}


def mixed(base: str, pid: int, total: int) -> dict[str, Any]:
    """Phase 4: `total` requests over four keyed clients, one in 20 the heaviest of its kind."""
    warm = rss_mb(pid)
    small: list[Request] = [
        ("/classify", {"inputs": "a charming and often affecting journey"}),
        ("/ner", {"inputs": "Angela Merkel met Emmanuel Macron in Paris."}),
        ("/qa", {"inputs": {"question": "where?", "context": CONTEXT}}),
        ("/fill-mask", {"inputs": "Paris is the capital of [MASK]."}),
        ("/nsp", {"inputs": {"text": "I went out.", "text_pair": "It rained."}}),
        ("/embed", {"inputs": "A man is eating food."}),
    ]
    big = heaviest()
    counter = iter(range(total))
    lock = threading.Lock()
    statuses: dict[int, int] = {}
    peak = [warm]

    def client() -> None:
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                path, body = big[i // 20 % len(big)] if i % 20 == 0 else small[i % len(small)]
                status, _ = post(c, path, body)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    peak[0] = max(peak[0], rss_mb(pid))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2)
    return {"warm_mb": warm, "peak_mb": peak[0], "after_mb": rss_mb(pid), "statuses": statuses}


def sample_peak(pid: int, peak: list[float], done: threading.Event) -> None:
    """Keep the largest resident size of `pid` in peak[0] until `done`."""
    while not done.is_set():
        peak[0] = max(peak[0], rss_mb(pid))
        time.sleep(0.005)


def fresh_status(base: str, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    """One request on a new connection (the kernel spreads those over the workers, as a
    Service spreads new connections over pods): its status, 0 for a transport error."""
    try:
        with httpx.Client(base_url=base, headers=AUTH, timeout=30) as c:
            return c.request(method, path, json=body).status_code
    except httpx.TransportError:
        return 0


def kill_worker(base: str, supervisor: int, seconds: float) -> dict[str, Any]:
    """Phase 8: SIGKILL one of the workers under load. Eight clients send /classify on new
    connections while a prober asks /health/ready (each on a new connection) every 20 ms;
    one worker is killed 2 s in; the phase runs `seconds`, or until the replacement is
    ready, whichever is later. Counts the answers, and the seconds readiness said 503."""
    stop = threading.Event()
    statuses: dict[int, int] = {}

    def load() -> None:
        while not stop.is_set():
            status = fresh_status(base, "POST", "/classify", {"inputs": "fine"})
            statuses[status] = statuses.get(status, 0) + 1

    clients = [threading.Thread(target=load) for _ in range(8)]
    for t in clients:
        t.start()
    first = worker_pids(supervisor)
    ready: list[tuple[float, int]] = []
    started = time.monotonic()
    killed = replaced = None
    warm = False
    while True:
        now = time.monotonic() - started
        ready.append((now, fresh_status(base, "GET", "/health/ready")))
        if killed is None and now > 2:
            killed = first[0]
            os.kill(killed, 9)
        pids = worker_pids(supervisor)
        if killed and replaced is None and len(pids) == len(first) and killed not in pids:
            replaced = now
        with contextlib.suppress(httpx.TransportError):
            text = httpx.get(f"{base}/metrics", timeout=5).text
            warm = f"bertserve_ready {float(1)}" in text
        if now > seconds and replaced is not None and warm:
            break
        time.sleep(0.02)
    stop.set()
    for t in clients:
        t.join()
    not_ready = sum(
        later[0] - earlier[0] for earlier, later in itertools.pairwise(ready) if earlier[1] != 200
    )
    lost = [
        line
        for line in httpx.get(f"{base}/metrics").text.splitlines()
        if line.startswith("bertserve_worker_lost_requests_total")
    ]
    return {
        "classify_statuses": statuses,
        "ready_statuses": {s: sum(1 for _, x in ready if x == s) for s in {x for _, x in ready}},
        "ready_not_200_s": round(not_ready, 2),
        "replacement_started_s": replaced,
        "phase_s": round(time.monotonic() - started, 1),
        "lost_metric": lost,
    }


def alone(base: str, pid: int) -> dict[str, Any]:
    """Phase 5: each endpoint's heaviest allowed request alone, twice (the second shows what
    the first left), the worker's resident memory sampled every 5 ms meanwhile: warm, peak
    and after, in MB."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base, headers=AUTH, timeout=120) as c:
        for path, body in heaviest():
            for attempt in (1, 2):
                before = rss_mb(pid)
                peak = [before]
                done = threading.Event()
                sampler = threading.Thread(target=sample_peak, args=(pid, peak, done))
                sampler.start()
                status, elapsed = post(c, path, body)
                done.set()
                sampler.join()
                time.sleep(1.5)  # the worker's heap trim runs at most once a second
                out[f"{path} #{attempt}"] = {
                    "status": status,
                    "ms": round(1000 * elapsed),
                    "before_mb": round(before),
                    "peak_mb": round(peak[0]),
                    "after_mb": round(rss_mb(pid)),
                }
                print(path, attempt, out[f"{path} #{attempt}"], flush=True)
    return out


def tree_commit(tree: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()


def report(results: dict[str, Any], commit: str) -> str:
    """The markdown report; `commit`: the tree's, taken when the server started."""
    lines = [
        "# The adversarial review's targets, measured",
        "",
        f"`bertserve bench attack` at {commit}, {time.strftime('%Y-%m-%d')}, on this machine "
        f"({os.cpu_count()} cores): `bertserve serve` on the shipped bundles, one worker, "
        "an API key set. Targets from docs/security.md.",
        "",
        "## 1. Each repro once",
        "",
        "| request | status | ms | worker growth MB |",
        "|---|---|---|---|",
    ]
    for name, r in results["repros"].items():
        lines.append(f"| {name} | {r['status']} | {r['ms']:.0f} | {r['growth_mb']:+.0f} |")
    e = results["expensive"]
    lines += [
        "",
        "## 2. Two clients sending each endpoint's most expensive allowed request",
        "",
        f"- small /classify p50: {e['idle_p50_ms']:.1f} ms idle, {e['loaded_p50_ms']:.1f} ms "
        f"under the two clients ({e['loaded_p50_ms'] / e['idle_p50_ms']:.2f}x; target <= 2x); "
        f"{e['small_not_200']} not 200",
        f"- /health/live on fresh connections: max {e['live_max_ms']:.1f} ms, p99 "
        f"{e['live_p99_ms']:.1f} ms (target <= 50 ms)",
        f"- heavy requests sent: {e['heavy_requests']}; their statuses: {e['heavy_statuses']}",
    ]
    m = results["misbehave"]
    lines += [
        "",
        f"## 3. {m['attackers']} unauthenticated connections misbehaving",
        "",
        f"Keyed /classify answers meanwhile, by status: {m['keyed']} (target: no 503).",
    ]
    x = results["mixed"]
    lines += [
        "",
        "## 4. 10,000 mixed requests, the heaviest allowed one in every 20",
        "",
        f"Resident: warm {x['warm_mb']:.0f} MB, peak {x['peak_mb']:.0f} MB, after "
        f"{x['after_mb']:.0f} MB ({x['after_mb'] / x['warm_mb']:.2f}x warm; target <= 1.2x, "
        f"or recycled with BERTSERVE_MAX_WORKER_RSS_MB). Statuses: {x['statuses']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the source tree to serve")
    parser.add_argument("--report", type=Path, help="write the markdown report here")
    parser.add_argument("--seconds", type=float, default=20, help="phases 2 and 3")
    parser.add_argument("--mixed", type=int, default=10_000, help="phase 4's requests")
    parser.add_argument("--attackers", type=int, default=500)
    parser.add_argument(
        "--phases",
        default="1234",
        help="which phases to run, in this order, e.g. 2; 5 (each endpoint's heaviest request "
        "alone, the worker's memory around it) and 6 (one client sending the heaviest /qa in "
        "a loop, another small /classify) and 7 (16 connections sending endless chunked "
        "trailers) and 8 (SIGKILL one worker under load; ATTACK_WORKERS=2) only when asked",
    )
    args = parser.parse_args(argv)
    measured = tree_commit(args.tree)  # before the server starts: the tree may change meanwhile
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = ROOT / "runs" / "bench-attack.log"
    log.parent.mkdir(exist_ok=True)
    proc = start(args.tree, port, log)
    results: dict[str, Any] = {"repros": {}}
    try:
        with httpx.Client(base_url=base, headers=AUTH, timeout=120) as c:
            for name, (path, body) in repros().items() if "1" in args.phases else ():
                before = rss_mb(proc.pid)
                status, elapsed = post(c, path, body)
                results["repros"][name] = {
                    "status": status,
                    "ms": 1000 * elapsed,
                    "growth_mb": rss_mb(proc.pid) - before,
                }
                print(name, results["repros"][name], flush=True)
        phases = {
            "2": "expensive",
            "3": "misbehave",
            "4": "mixed",
            "5": "alone",
            "6": "one heavy key",
            "7": "trailers",
            "8": "kill a worker",
        }
        for number in dict.fromkeys(args.phases):  # in the order given: 54 = 4 after 5
            name = phases.get(number, "")
            if name:
                if name == "expensive":
                    results[name] = expensive_clients(base, args.seconds)
                elif name == "misbehave":
                    results[name] = misbehave(base, args.attackers, args.seconds)
                elif name == "alone":
                    results[name] = alone(base, proc.pid)
                elif name == "kill a worker":
                    results[name] = kill_worker(base, proc.pid, args.seconds)
                elif name == "trailers":
                    results[name] = trailers(base, worker_pids(proc.pid), 16, args.seconds)
                elif name == "one heavy key":
                    results[name] = expensive_clients(base, args.seconds, heaviest_qa(), 1)
                else:
                    results[name] = mixed(base, proc.pid, args.mixed)
                print(name, results[name], flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if args.phases != "1234":
        return  # a partial run: the figures above, no report (phase 5 is always partial)
    text = report(results, measured)
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
