"""A real uvicorn server on a loopback port, in a thread of the test process, so tests talk real
HTTP and can still reach the app's state (to inject faults)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from bertserve.service.http.app import create_app
from bertserve.service.process.server import DrainingServer, uvicorn_config
from bertserve.service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app, server: uvicorn.Server, url: str) -> None:
        self.app, self.server, self.url = app, server, url

    @property
    def state(self):
        return self.app.state.service

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                if c.get("/health/ready").status_code == 200:
                    return
                time.sleep(0.02)
        raise TimeoutError("service never became ready")


@contextmanager
def live_server(wait: bool = True, draining: bool = False, **settings: Any) -> Iterator[LiveServer]:
    """The app on a real uvicorn server in a thread; `draining=True` runs the service's own
    DrainingServer (its drain is started by calling `handle_exit`)."""
    port = free_port()
    settings.setdefault("metrics_cache_s", 0.0)  # tests read /metrics right after a request
    config_settings = Settings(host="127.0.0.1", port=port, intra_op_threads=1, **settings)
    app = create_app(config_settings)
    config = uvicorn_config(app, config_settings)  # as the service runs
    server = (
        DrainingServer(config, app.state.service, config_settings.drain_timeout_s)
        if draining
        else uvicorn.Server(config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    live = LiveServer(app, server, f"http://127.0.0.1:{port}")
    try:
        if wait:
            live.wait_ready()
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def probe_live_while(server: LiveServer, work: Any) -> tuple[list[float], Any]:
    """Run `work()` on a thread while /health/live is probed every 5 ms: the probes' latencies
    and what `work` returned."""
    done, result = threading.Event(), {}

    def run() -> None:
        try:
            result["value"] = work()
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    latencies = []
    with httpx.Client(base_url=server.url, timeout=5) as c:
        while not done.is_set():
            started = time.perf_counter()
            assert c.get("/health/live").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
    thread.join()
    return latencies, result.get("value")


def assert_prompt(latencies: list[float], detail: Any = None) -> None:
    """Liveness within 50 ms while a heavy request runs. One probe may meet a scheduling hiccup
    of a shared 2-core machine (CI saw 50.4 ms once, the rest under 21) and gets 250 ms; an
    event loop held by the request would delay probe after probe."""
    slowest = sorted(latencies)[-2:]
    assert slowest[0] < 0.05 and slowest[-1] < 0.25, (slowest, detail)


def rss_mb() -> float:
    """This process's resident memory, in MiB: a LiveServer runs in the test process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def host_port(server: LiveServer) -> tuple[str, int]:
    """Where a LiveServer listens, for tests that speak raw sockets."""
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)
