"""Start and stop the servers under test: ours and the peers, each in a process group of its own
so that everything it spawned (uvicorn workers, LitServe's inference worker, Ray's daemons)
goes when it stops."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import wait_ready

PEERS = {
    "transformers": "bench.peers.hf_pipeline",
    "fastapi-ort": "bench.peers.ort_plain",
    "litserve": "bench.peers.litserve_peer",
    "ray-serve": "bench.peers.ray_peer",
}
OURS = "bertserve"
# Servers a bench runs beside bertserve that are not /classify peers: the rerank peer
# (bench.experiments.rerank) and a floor that serves no model.
PROBES = {"cross-encoder": "bench.peers.cross_encoder", "http-floor": "bench.peers.floor"}


@dataclass
class Server:
    name: str
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    startup_s: float

    def url(self, endpoint: str) -> str:
        return f"{self.base}/{endpoint}"


def only_bundles(source: Path, names: list[str], out: Path) -> Path:
    """A bundles directory `out` holding just `names` (links into `source`): bertserve serves
    every bundle it finds, and with the shipped ones /classify goes to the default model (MiniLM)
    whatever bundle a bench means to measure."""
    return linked_bundles([source / name for name in names], out)


def linked_bundles(bundles: list[Path], out: Path) -> Path:
    """A bundles directory `out` holding just these bundle directories (links, by their
    directories' names), wherever each lies."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for bundle in bundles:
        (out / bundle.name).symlink_to(bundle.resolve())
    return out


@dataclass(frozen=True)
class Launch:
    """How to start another source tree's service: its import path (PYTHONPATH), the folder
    to start it from, and its module."""

    env: dict[str, str]
    cwd: Path
    module: str


def from_tree(tree: Path, work: Path) -> Launch:
    """`tree`'s service, not the installed checkout's. A tree from before the one import name
    runs as `python -m service` from its own folder; a tree whose folders install as
    `bertserve.*` (pyproject.toml's package-dir) gets a link farm under `work` and starts from
    there: `python -m` puts its working directory first on sys.path, and from the tree's own
    folder its bertserve/ (no service/ in it) was found first and the editable install's finder
    supplied this checkout's service."""
    tree = tree.resolve()
    if '"bertserve.service" = "service"' not in (tree / "pyproject.toml").read_text():
        return Launch({"PYTHONPATH": str(tree)}, tree, "service")
    farm = work.resolve() / "trees" / hashlib.sha256(str(tree).encode()).hexdigest()[:12]
    shutil.rmtree(farm, ignore_errors=True)
    (farm / "bertserve").mkdir(parents=True)
    for path in (tree / "bertserve").glob("*.py"):
        (farm / "bertserve" / path.name).symlink_to(path.resolve())
    for folder in ("export", "model", "runtime", "service"):
        (farm / "bertserve" / folder).symlink_to((tree / folder).resolve())
    return Launch({"PYTHONPATH": str(farm)}, farm, "bertserve.service")


def command(
    name: str, bundles: Path, bundle: Path, port: int, module: str = "bertserve.service"
) -> list[str]:
    if name == OURS:
        return [
            sys.executable,
            "-m",
            module,
            "--bundles",
            str(bundles),
            "--port",
            str(port),
        ]
    module = PEERS.get(name) or PROBES[name]
    return [sys.executable, "-m", module, "--bundle", str(bundle), "--port", str(port)]


def refuse_taken_port(port: int) -> None:
    """Exit naming the port if something listens on it: the readiness probe would otherwise be
    answered by that server (a run left over) and the bench measure it, not the one it
    started, whose bind failed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(
                f"port {port} is taken (a server left from an earlier run?): stop it or pass "
                "another --port"
            )


@contextmanager
def serve(
    name: str,
    bundles: Path,
    bundle: Path,
    port: int,
    ready_body: bytes,
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    ready_path: str = "/classify",
    module: str = "bertserve.service",
    headers: dict[str, str] | None = None,
) -> Iterator[Server]:
    """Run server `name` until the block ends; ready once POST `ready_path` answers 200.
    `cwd`: the source tree to run (`python -m` imports from the working directory first);
    `module`: ours, as that tree names it; `headers`: the readiness request's (a key)."""
    refuse_taken_port(port)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command(name, bundles, bundle, port, module),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | (env or {}),
            cwd=cwd,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}{ready_path}", ready_body, timeout=300, proc=proc, headers=headers)
        yield Server(name, base, proc, time.monotonic() - started)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM the group, then SIGKILL whatever is left of it."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; children (Ray's raylet, LitServe's workers) may not be.
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return
