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

from service.app import create_app
from service.server import DrainingServer, uvicorn_config
from service.settings import Settings


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
