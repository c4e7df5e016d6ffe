"""The checks of `make image-test` (tools/image-test.sh) against a running image or stack.

    python tools/image_check.py image bertserve:cpu
    python tools/image_check.py compose http://127.0.0.1:8000 http://127.0.0.1:9090

Each check prints one line; the first that fails stops the run with its reason (exit 1).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

NAME = "bertserve-image-test"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's service package
from bertserve.runtime.tasks import TASKS  # noqa: E402

REQUESTS = {path: task.example for path, task in TASKS.items()}


class CheckFailed(RuntimeError):
    pass


def check(what: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise CheckFailed(f"{what}: {detail}")
    print(f"image-test: ok  {what}" + (f" ({detail})" if detail != "" else ""))  # noqa: T201


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 120) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise CheckFailed(f"{url}/health/ready never answered 200 in {timeout:.0f} s")


def shipped_tasks() -> set[str]:
    """The bundle tasks of the bundles the image carries (the checkout's bundles/)."""
    bundles = Path(__file__).resolve().parents[1] / "bundles"
    return {t for b in bundles.glob("*/bundle.json") for t in json.loads(b.read_text())["tasks"]}


def every_endpoint(url: str) -> None:
    """Every endpoint whose example some shipped bundle can answer (it serves every capability
    the example needs: /encode's asks for the dense and sparse heads of one bundle) answers it
    with 200; every other endpoint answers 404 naming the missing task, not 500."""
    with httpx.Client(base_url=url, timeout=30) as c:
        models = [set(m["tasks"]) for m in c.get("/models").json()]
        served = set().union(*models)
        check("every shipped task is served", served == shipped_tasks(), sorted(served))
        for path, task in TASKS.items():
            response = c.post(path, json=REQUESTS[path])
            needs = {task.capability, *task.needs(task.request.model_validate(REQUESTS[path]))}
            if any(needs <= tasks for tasks in models):
                check(f"POST {path}", response.status_code == 200, response.text[:120])
            else:
                check(
                    f"POST {path} without a bundle of {'+'.join(sorted(needs))}",
                    response.status_code == 404 and task.capability in response.text,
                    response.text[:120],
                )


def image(tag: str) -> None:
    size = int(docker("image", "inspect", "-f", "{{.Size}}", tag))
    check("image size", True, f"{size / 1e6:.0f} MB")
    port = free_port()
    docker(
        "run", "-d", "--name", NAME, "--read-only", "--tmpfs", "/tmp",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
        "-p", f"127.0.0.1:{port}:8000", tag,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        check("ready (read-only root)", True, f"{wait_ready(url):.1f} s")
        every_endpoint(url)
        uid = docker("exec", NAME, "python", "-c", "import os; print(os.getuid())")
        check("runs as non-root", uid == "10001", f"uid {uid}")
        write = subprocess.run(
            ["docker", "exec", NAME, "python", "-c", "open('/app/x', 'w')"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        check("root filesystem is read-only", "Read-only file system" in write.stderr)
        sigterm_drains(url)
    finally:
        logs = subprocess.run(["docker", "logs", NAME], capture_output=True, text=True, check=False)
        if "Traceback" in logs.stdout + logs.stderr:
            print(logs.stderr[-3000:], file=sys.stderr)  # noqa: T201


def engine_process(tag: str) -> None:
    """The GPU topology in the container as it ships (read-only root: the engine's socket goes
    in the /tmp tmpfs), limited to 1 CPU: one worker (the quota, not the host's cores) feeding
    one engine process; every endpoint; `docker stop` exits 0."""
    port = free_port()
    docker(
        "run", "-d", "--name", NAME, "--read-only", "--tmpfs", "/tmp",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true", "--cpus", "1",
        "-e", "BERTSERVE_ENGINE_PROCESS=true", "-p", f"127.0.0.1:{port}:8000", tag,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        check("engine process: ready", True, f"{wait_ready(url):.1f} s")
        every_endpoint(url)
        logs = subprocess.run(["docker", "logs", NAME], capture_output=True, text=True, check=False)
        text = logs.stdout + logs.stderr
        check(
            "engine process: 1 worker at --cpus 1 (the host has more), one engine",
            "with 1 worker and one engine process (ONNX Runtime threads: 1)" in text,
            next((line for line in text.splitlines() if "serving on" in line), "no start line"),
        )
        docker("stop", "-t", "45", NAME)
        code = docker("inspect", "-f", "{{.State.ExitCode}}", NAME)
        check("engine process: SIGTERM exit status 0", code == "0", code)
    finally:
        docker("rm", "-f", NAME)


def sigterm_drains(url: str) -> None:
    """Requests in flight when `docker stop` sends SIGTERM are all answered; exit status 0."""
    # Two long contexts a request (20 rows): if every one of the 16 lands on one worker, they
    # still finish inside the 30 s deadline on 2 cores. With four (40 rows) they did not, and
    # the bulk bound, which counts queued rows at a rate measured mostly on short ones, admitted
    # them: some answered 504, a capacity limit this drain check is not about.
    context = "the king of france was born in paris . " * 150
    body = {"inputs": [{"question": "where was the king born ?", "context": context}] * 2}

    def ask() -> int:
        return httpx.post(f"{url}/qa", json=body, timeout=60).status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask) for _ in range(16)]
        time.sleep(0.3)  # in flight
        docker("stop", "-t", "45", NAME)
        statuses = [f.result() for f in futures]
    # 503 (draining) and 429 (the queue already held BERTSERVE_MAX_QUEUE_WAIT_MS of work) are
    # refusals with Retry-After, not admitted requests. Some must have been admitted, or the
    # check proves nothing (a queue bound once refused all 16: the other CI runs had 5-7 200s).
    admitted = [s for s in statuses if s not in (429, 503)]
    answered = bool(admitted) and all(s == 200 for s in admitted)
    check("SIGTERM: admitted requests answered", answered, statuses)
    code = docker("inspect", "-f", "{{.State.ExitCode}}", NAME)
    check("SIGTERM: exit status 0", code == "0", code)


def compose(service_url: str, prometheus_url: str) -> None:
    check("stack: bertserve ready", True, f"{wait_ready(service_url, 180):.1f} s")
    sent = 20
    with httpx.Client(base_url=service_url, timeout=30) as c:
        for _ in range(sent):
            c.post("/classify", json=REQUESTS["/classify"]).raise_for_status()
    classify = '{endpoint="/classify"}'
    queries = {
        "bertserve_requests_total": f"sum(bertserve_requests_total{classify})",
        "latency histogram": f"sum(bertserve_request_duration_seconds_count{classify})",
    }
    deadline = time.monotonic() + 90
    for what, query in queries.items():
        value = 0.0
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": query}).json()
                result = answer["data"]["result"]
                value = float(result[0]["value"][1]) if result else 0.0
            except (httpx.TransportError, json.JSONDecodeError, KeyError):
                value = 0.0
            if value >= sent:
                break
            time.sleep(1)
        check(f"Prometheus scraped {what}", value >= sent, f"{value:.0f} of {sent}")


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["image"]:
            image(argv[1])
            docker("rm", "-f", NAME)
            engine_process(argv[1])
        elif argv[:1] == ["compose"]:
            compose(argv[1], argv[2])
        else:
            raise CheckFailed(f"usage: {__doc__.splitlines()[2].strip()}")
    except CheckFailed as exc:
        print(f"image-test: FAILED {exc}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
