"""`bertserve serve` as a real process: start-up errors, and SIGTERM under load."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import free_port

pytestmark = pytest.mark.slow


def start(bundles, port, new_session=False, **env):
    environment = {
        **os.environ,
        "BERTSERVE_INTRA_OP_THREADS": "1",
        **{f"BERTSERVE_{k.upper()}": str(v) for k, v in env.items()},
    }
    return subprocess.Popen(
        [sys.executable, "-m", "bertserve.service", "--bundles", str(bundles), "--port", str(port)],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def wait_ready(url, process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(f"{url}/health/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("service never became ready")


@pytest.mark.parametrize(
    ("topology", "group"),
    [("workers", False), ("engine process", False), ("workers", True)],
    ids=["workers", "engine process", "process group"],
)
def test_sigterm_under_load_loses_no_admitted_request(bundle_dir, topology, group):
    """Two serving processes (the supervisor passes SIGTERM on): every admitted request is
    answered, a late one gets 503, and the exit status is 0. With the engine process, it is
    stopped after the workers have drained, so their last batches still run. `group`: SIGTERM
    to the whole process group, as systemd and a shell's job control send it: each worker
    gets it twice (once from the supervisor), and drains all the same."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"engine_process": "true"} if topology == "engine process" else {}
    process = start(bundle_dir, port, group, max_wait_ms=1500, drain_timeout_s=20, workers=2, **env)
    try:
        wait_ready(url, process)

        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                tasks = [
                    asyncio.create_task(c.post("/classify", json={"inputs": f"sentence {i}"}))
                    for i in range(16)
                ]
                while (
                    'bertserve_queue_depth{model="sentiment"} 16.0'
                    not in (await c.get("/metrics")).text
                ):  # all 16 admitted, waiting in the batch window
                    await asyncio.sleep(0.02)
                if group:
                    os.killpg(process.pid, signal.SIGTERM)
                else:
                    process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.05)
                # On a new connection: an idle kept-alive one is closed at the drain's start,
                # and a request written on it in that instant is reset, unanswered (the <= 1%
                # the issue allows); the full suite's load made that race flaky here.
                async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
                    late = await fresh.post("/classify", json={"inputs": "after the signal"})
                return await asyncio.gather(*tasks), late

        responses, late = asyncio.run(load())
        assert [r.status_code for r in responses] == [200] * 16
        assert late.status_code == 503 and late.json()["error_type"] == "unavailable"
        assert process.wait(timeout=30) == 0
        logs = process.stdout.read()
        lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        drained = [
            int(x["message"].split("draining ")[1].split()[0])
            for x in lines
            if "in-flight requests" in x.get("message", "")
        ]
        assert len(drained) == 2 and sum(drained) >= 16, drained  # each worker drained its own
        served = [x for x in lines if x.get("endpoint") == "/classify" and x.get("status") == 200]
        assert len(served) == 16 and all("request_id" in x and "queue_ms" in x for x in served)
        if env:
            assert "engine process exited with 0" in logs
    finally:
        process.kill()


def test_startup_errors_are_one_line(bundle_dir, tmp_path):
    def run(*args, **env):
        environment = {**os.environ, **{f"BERTSERVE_{k.upper()}": str(v) for k, v in env.items()}}
        done = subprocess.run(
            [sys.executable, "-m", "bertserve.service", *args],
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        return done.stderr.strip()

    assert run("--bundles", str(tmp_path / "missing")) == (
        f"error: BERTSERVE_BUNDLES: Value error, bundle directory {tmp_path / 'missing'} does "
        "not exist"
    )
    assert "BERTSERVE_PORT" in run("--bundles", str(bundle_dir), port="http")
    assert "no bundles" in run("--bundles", str(tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(bundle_dir / "sentiment", broken / "sentiment")
    (broken / "sentiment" / "tokenizer.json").unlink()
    assert run("--bundles", str(broken)).endswith("tokenizer.json: missing (named in bundle.json)")
    # An altered model file: refused before any worker starts, in one line naming the file
    # and what differs (the review saw a traceback from inside the workers, 6 s in).
    altered = tmp_path / "altered"
    shutil.copytree(bundle_dir / "sentiment", altered / "sentiment")
    with (altered / "sentiment" / "model.onnx").open("ab") as f:
        f.write(b"\0")
    started = time.monotonic()
    line = run("--bundles", str(altered), workers=2)
    assert "\n" not in line and line.startswith(f"error: {altered / 'sentiment' / 'model.onnx'}")
    assert "is not the" in line and "that bundle.json records" in line
    assert time.monotonic() - started < 5
    assert "BERTSERVE_MAX_BATCH_TOKENS" in run("--bundles", str(bundle_dir), max_batch_tokens=4)


def worker_pids(supervisor_pid: int) -> list[int]:
    children = subprocess.run(
        ["pgrep", "-P", str(supervisor_pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    pids = []
    for pid in map(int, children):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:  # exited meanwhile
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return sorted(pids)


def test_workers_share_the_port_metrics_and_readiness_and_a_dead_one_is_replaced(bundle_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(bundle_dir, port, workers=2)
    try:
        wait_ready(url, process)
        pids = worker_pids(process.pid)
        assert len(pids) == 2
        with httpx.Client(base_url=url, timeout=30) as c:
            # New connections each: the kernel spreads them over both processes.
            for i in range(40):
                with httpx.Client(base_url=url, timeout=30) as fresh:
                    assert fresh.post("/classify", json={"inputs": f"text {i}"}).status_code == 200
            text = c.get("/metrics").text
            # One scrape, whichever process answers it, counts all 40 (summed over processes).
            assert 'bertserve_requests_total{endpoint="/classify",status="200"} 40.0' in text
            assert 'bertserve_request_duration_seconds_count{endpoint="/classify"} 40.0' in text
            assert "bertserve_ready 1.0" in text
            # Open connections, summed over both processes: ten that send nothing, and this
            # client's own (the 40 fresh clients have closed theirs).
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
            try:
                assert settles(lambda: open_connections(c), 11)
            finally:
                for sock in idle:
                    sock.close()
            assert settles(lambda: open_connections(c), 1)

            os.kill(pids[0], signal.SIGKILL)
            # The replacement accepts nothing until it is warm, and the live worker speaks for
            # itself: readiness stays 200 and no new connection meets a warming worker's 503.
            statuses: dict[str, list[int]] = {"ready": [], "classify": []}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                replaced = worker_pids(process.pid)
                if len(replaced) == 2 and pids[0] not in replaced and len(statuses["ready"]) > 50:
                    break
                with httpx.Client(base_url=url, timeout=30) as fresh:
                    try:
                        statuses["ready"].append(fresh.get("/health/ready").status_code)
                        response = fresh.post("/classify", json={"inputs": "still here"})
                        statuses["classify"].append(response.status_code)
                    except httpx.TransportError:  # a connection the killed worker held
                        continue
            assert set(statuses["ready"]) == {200}, statuses["ready"]
            assert set(statuses["classify"]) == {200}, statuses["classify"]
            replaced = worker_pids(process.pid)
            assert len(replaced) == 2 and pids[0] not in replaced and pids[1] in replaced
            assert "bertserve_worker_lost_requests_total 0.0" in c.get("/metrics").text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "died with -9 and 0 requests in flight: replacing it" in process.stdout.read()
    finally:
        process.kill()


def test_a_worker_killed_while_bodies_arrive_counts_them_lost(bundle_dir):
    """The review's finding: `bertserve_worker_lost_requests_total` counted a dead worker's
    requests in flight, not those still sending their bodies, whose clients get no answer
    either. Two admitted bodies half sent (to either worker), then both workers killed: the
    two are counted."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(bundle_dir, port, workers=2)
    try:
        wait_ready(url, process)
        pids = worker_pids(process.pid)
        body = json.dumps({"inputs": "a body that never ends"}).encode()
        head = b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        halves = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
            halves.append(sock)
        time.sleep(1)  # read and admitted: each holds a receiving place
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            replaced = worker_pids(process.pid)
            if len(replaced) == 2 and not set(pids) & set(replaced):
                break
            time.sleep(0.1)
        wait_ready(url, process)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert "bertserve_worker_lost_requests_total 2.0" in c.get("/metrics").text
        for sock in halves:
            sock.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


def open_connections(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("bertserve_open_connections "):
            return float(line.split()[1])
    raise AssertionError("no bertserve_open_connections in /metrics")


def settles(read, expected: float, timeout: float = 5.0) -> bool:
    """`read()` reaches `expected` within `timeout` (connections close asynchronously)."""
    deadline = time.monotonic() + timeout
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value == expected


def unloadable_bundles(bundle_dir, tmp_path):
    """A bundle directory whose one model.onnx ONNX Runtime cannot load (its sha256 matches,
    so the service gets as far as building the session)."""
    import hashlib

    bundles = tmp_path / "bundles"
    shutil.copytree(bundle_dir / "sentiment", bundles / "sentiment")
    (bundles / "sentiment" / "model.onnx").write_bytes(b"not a model")
    spec = json.loads((bundles / "sentiment" / "bundle.json").read_text())
    spec["model_sha256"] = hashlib.sha256(b"not a model").hexdigest()
    (bundles / "sentiment" / "bundle.json").write_text(json.dumps(spec))
    return bundles


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init, or not, in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("topology", ["workers", "engine process"])
def test_a_killed_supervisor_takes_its_workers_with_it(bundle_dir, topology):
    """SIGKILL of the supervisor (the OOM killer, `kill -9`) leaves no orphan serving on the
    port with nobody to replace or drain it: every worker, and the engine process, exits."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"engine_process": "true"} if topology == "engine process" else {}
    process = start(bundle_dir, port, workers=2, **env)
    children: list[int] = []
    try:
        wait_ready(url, process)
        children = worker_pids(process.pid)
        assert len(children) == 2 + len(env)
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(map(running, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(running, children)), [p for p in children if running(p)]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health/live")
        assert "the supervisor (pid" in process.stdout.read()
    finally:
        process.kill()
        for pid in filter(running, children):
            os.kill(pid, signal.SIGKILL)


def test_workers_that_cannot_start_stop_the_supervisor(bundle_dir, tmp_path):
    """A worker that dies before it was ever ready is not restarted in a loop: the supervisor
    stops the others and exits 1, so the orchestrator sees the failure."""
    process = start(unloadable_bundles(bundle_dir, tmp_path), free_port(), workers=2)
    try:
        assert process.wait(timeout=60) == 1
        assert "before it was ready: stopping" in process.stdout.read()
    finally:
        process.kill()


def recycling_service(bundle_dir, tmp_path):
    """Two workers with a 1 MB memory ceiling, so every worker asks for a successor at once:
    its URL, process and log file (thousands of access lines: a pipe would fill and block)."""
    port = free_port()
    log = (tmp_path / "log").open("w+")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bertserve.service",
            "--bundles",
            str(bundle_dir),
            "--port",
            str(port),
        ],
        env={**os.environ, "BERTSERVE_WORKERS": "2", "BERTSERVE_MAX_WORKER_RSS_MB": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return f"http://127.0.0.1:{port}", process, log


def stop_and_read(process, log) -> str:
    """SIGTERM, wait for the drain (or kill), and the whole log."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    finally:
        process.kill()
        log.seek(0)
    return log.read()


def test_a_worker_over_its_memory_ceiling_is_replaced_without_a_lost_request(bundle_dir, tmp_path):
    """max_worker_rss_mb: a worker past it gets a successor, and only once that is ready does
    it retire, finishing what it admitted. A ceiling of 1 MB makes every worker ask at once,
    so workers are replaced back to back while a client keeps sending: every request is
    answered 200, none refused or reset."""
    url, process, log = recycling_service(bundle_dir, tmp_path)
    statuses: dict[int, int] = {}
    errors = []
    try:
        wait_ready(url, process)
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=url, timeout=10) as c:
            while time.monotonic() < deadline:
                try:
                    status = c.post("/classify", json={"inputs": "fine"}).status_code
                    statuses[status] = statuses.get(status, 0) + 1
                except httpx.TransportError as exc:
                    errors.append(repr(exc))
                if statuses.get(200, 0) > 50 and time.monotonic() > deadline - 15:
                    break
    finally:
        output = stop_and_read(process, log)
    lines = output.splitlines()
    retired = [line for line in lines if "retired with 0" in line]
    assert retired, output[-3000:]
    assert errors == [] and set(statuses) == {200}, (statuses, errors)
    assert process.returncode == 0, output[-3000:]


def test_a_successor_killed_while_it_starts_is_started_again(bundle_dir, tmp_path):
    """The review's finding: a recycled worker's successor killed while it starts (the
    out-of-memory killer, when memory is tight) stopped the whole service. Now it is started
    again with back-off, the old worker serving meanwhile, and the recycling completes."""
    url, process, log = recycling_service(bundle_dir, tmp_path)
    statuses: dict[int, int] = {}
    retried = "before it was ready: starting it again in"
    killed: list[int] = []
    try:
        wait_ready(url, process)
        seen = set(worker_pids(process.pid))
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=url, timeout=10) as c:
            while time.monotonic() < deadline:
                assert process.poll() is None
                log.seek(0)
                text = log.read()
                if retried not in text:
                    # Each new successor, the moment it appears, until one was killed before
                    # it was ready (on a loaded machine one may get ready first: then again).
                    for pid in set(worker_pids(process.pid)) - seen:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    seen |= set(killed)
                elif "retires" in text.split(retried, 1)[1]:
                    break
                status = c.post("/classify", json={"inputs": "fine"}).status_code
                statuses[status] = statuses.get(status, 0) + 1
    finally:
        output = stop_and_read(process, log)
    assert killed
    assert retried + " 0.5 s" in output, output[-3000:]
    assert "retires" in output.split(retried, 1)[1], output[-3000:]
    assert set(statuses) == {200}, statuses
    assert process.returncode == 0, output[-3000:]
