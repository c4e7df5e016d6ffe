"""The HTTP protocol's own answers (service/http/protocol.py), over raw sockets so that
keep-alive and connection closes are visible: refusals made before a request becomes an ASGI
task, the connection cap, and draining."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from bertserve.runtime.batching import gather
from bertserve.service.http.asgi import CONNECTION_LOST, disconnect_watch
from bertserve.service.http.errors import ClientGone, NotReady
from bertserve.service.http.protocol import encode
from bertserve.service.process import server as server_module
from bertserve.service.process.server import ACCEPT_BURST, accept_share
from tests.helpers.server import live_server
from tests.service.test_behaviour import metric, until, wrap

pytestmark = pytest.mark.slow

BODY = json.dumps({"inputs": "a fine film"}).encode()


def post(path: str, body: bytes = BODY, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: test", "content-type: application/json"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


Response = tuple[int, dict[str, str], bytes]


def read_responses(sock: socket.socket, n: int) -> list[Response]:
    """The next `n` HTTP/1.1 responses (each with a Content-Length): status, headers
    (lower-case), body. Answers to pipelined requests can share one recv(): all `n` are parsed
    from one buffer, and a byte past the n-th fails the test rather than being dropped."""
    data, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        length = int(headers["content-length"])
        while len(data) < length:
            data += sock.recv(65536)
        out.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    assert not data, f"more bytes than {n} responses: {data!r}"
    return out


def read_response(sock: socket.socket) -> Response:
    return read_responses(sock, 1)[0]


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def one_request_held(live) -> Iterator[None]:
    """One /classify request held in the model until the block ends: with max_in_flight=1,
    every other API request meets the in-flight cap."""
    gate = threading.Event()
    wrap(live, "sentiment", gate=gate)
    held = threading.Thread(
        target=lambda: httpx.post(f"{live.url}/classify", json={"inputs": "x"}, timeout=30)
    )
    held.start()
    asyncio.run(until(lambda: live.state.in_flight == 1))
    try:
        yield
    finally:
        gate.set()
        held.join(30)


def connect(live) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def test_a_refusal_never_reaches_the_app_and_keeps_the_connection(bundle_dir, caplog):
    """At the in-flight cap a request with a short body (under queue_min_body_bytes: one short
    text, never a client batch to wait) is answered 503 by the protocol: Retry-After, the
    client's request id, no access-log line (no task ran), counted in the metrics; the
    connection stays open and serves the next request once there is room."""
    with live_server(bundles=bundle_dir, max_in_flight=1) as live:  # a short body: no waiting
        caplog.set_level(logging.INFO, logger="bertserve.access")
        with connect(live) as sock:
            with one_request_held(live):
                sock.sendall(post("/classify", x_request_id="refused-1"))
                status, headers, body = read_response(sock)
                assert status == 503
                assert headers["retry-after"] == "1" and headers["x-request-id"] == "refused-1"
                assert "connection" not in headers  # overload: retry here, on this connection
                assert json.loads(body) == {
                    "error": "1 requests in flight (the limit); retry shortly",
                    "error_type": "unavailable",
                }
            asyncio.run(until(lambda: live.state.in_flight == 0))
            sock.sendall(post("/classify", x_request_id="admitted-1"))
            status, headers, body = read_response(sock)
            assert status == 200 and json.loads(body)[0]["label"]

        def logged() -> list[str]:
            return [getattr(r, "fields", {}).get("request_id") for r in caplog.records]

        asyncio.run(until(lambda: "admitted-1" in logged()))  # the line follows the answer
        assert "refused-1" not in logged()
        assert metric(live, "bertserve_requests_total", endpoint="/classify", status="503") == 1
        assert metric(live, "bertserve_errors_total", error_type="unavailable") == 1


def test_a_pipelined_request_meets_the_gate_when_its_turn_comes(bundle_dir):
    """The gate is the protocol's alone. A request pipelined behind another is decided when it
    is dispatched, not at its headers: here the service starts draining while the first is
    being answered, so the second gets the draining 503, the same bytes a request read first
    gets, after the first's 200 and before the close."""
    with live_server(bundles=bundle_dir) as live:
        gate = threading.Event()
        wrap(live, "sentiment", gate=gate)
        with connect(live) as sock:
            sock.sendall(
                post("/classify", x_request_id="first") + post("/classify", x_request_id="second")
            )
            asyncio.run(until(lambda: live.state.in_flight == 1))
            live.state.draining = True
            gate.set()
            (first, _, _), (status, headers, body) = read_responses(sock, 2)
            assert closed_by_server(sock)  # draining: the client should go elsewhere
        assert first == 200 and live.state.in_flight == 0
        with connect(live) as sock:  # read first: the protocol's pre-encoded refusal
            sock.sendall(post("/classify", x_request_id="second"))
            expected = read_response(sock)
    assert status == expected[0] == 503
    assert json.loads(body) == json.loads(expected[2])
    for name in ("connection", "retry-after", "content-type", "x-request-id"):
        assert headers[name] == expected[1][name], name
    assert headers["x-request-id"] == "second"


def test_the_app_admits_what_it_is_given_without_the_protocol(bundle_dir):
    """Served by another ASGI server, the app has no gate: the protocol is the only entrance
    that refuses. Past the in-flight cap, the app still answers what it is given, and counts
    no slot for it."""
    from bertserve.service.http.app import create_app
    from bertserve.service.settings import Settings

    app = create_app(Settings(bundles=bundle_dir))
    transport = httpx.ASGITransport(app=app)

    async def via_app():
        async with app.router.lifespan_context(app):
            await until(lambda: app.state.service.warmed)
            app.state.service.in_flight = 10**6  # far past max_in_flight
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return await c.post("/classify", json={"inputs": "x"})

    answer = asyncio.run(via_app())
    assert answer.status_code == 200, answer.text
    assert answer.json()[0]["label"] and app.state.service.in_flight == 10**6


def test_each_request_meets_the_gate_once(bundle_dir):
    """One admission decision a request, the protocol's: at its headers for a request it reads
    first, at its turn for one pipelined behind another."""
    with live_server(bundles=bundle_dir) as live:
        admission = live.state.admission
        decided: list[str] = []
        refusal = admission.refusal

        def counted(state, method, path, connections=0, size=-1, held=None):
            decided.append(path)
            return refusal(state, method, path, connections, size, held)

        admission.refusal = counted
        try:
            with connect(live) as sock:
                for _ in range(2):  # one at a time: the protocol decides
                    sock.sendall(post("/classify"))
                    assert read_response(sock)[0] == 200
                sock.sendall(post("/classify") * 3)  # pipelined: two decided at their turn
                assert [r[0] for r in read_responses(sock, 3)] == [200, 200, 200]
        finally:
            admission.refusal = refusal
        assert decided == ["/classify"] * 5
        assert live.state.in_flight == 0


def test_a_burst_in_one_loop_turn_is_held_to_the_in_flight_cap(bundle_dir):
    """Requests whose headers all arrive before any is answered: the protocol takes each one's
    slot as it admits it, so exactly max_in_flight of them run and the rest get 503 at once."""
    with live_server(bundles=bundle_dir, max_in_flight=3, max_queued_batches=0) as live:
        gate = threading.Event()
        wrap(live, "sentiment", gate=gate)
        socks = [connect(live) for _ in range(8)]
        try:
            for sock in socks:
                sock.sendall(post("/classify"))
            asyncio.run(until(lambda: live.state.in_flight == 3))
            refused, held = [], []
            for sock in socks:
                sock.settimeout(2)  # a refusal takes microseconds; a held one never comes
                try:
                    refused.append(read_response(sock))
                except TimeoutError:
                    held.append(sock)
            assert [r[0] for r in refused] == [503] * 5
            assert len(held) == 3 and live.state.in_flight == 3
            gate.set()
            for sock in held:
                sock.settimeout(10)
                assert read_response(sock)[0] == 200
            asyncio.run(until(lambda: live.state.in_flight == 0))
        finally:
            gate.set()
            for sock in socks:
                sock.close()


def test_past_the_connection_cap_a_request_gets_503_and_its_connection_closes(bundle_dir):
    with live_server(bundles=bundle_dir, max_connections=2) as live:
        asyncio.run(until(lambda: not live.server.server_state.connections))  # probes gone
        first, second = connect(live), connect(live)
        for sock in (first, second):
            sock.sendall(post("/classify"))
            assert read_response(sock)[0] == 200
        with connect(live) as third:
            third.sendall(post("/classify"))
            status, headers, body = read_response(third)
            assert status == 503 and headers["connection"] == "close"
            assert "2 connections open (the limit)" in json.loads(body)["error"]
            assert closed_by_server(third)
        first.close()
        asyncio.run(until(lambda: len(live.server.server_state.connections) <= 1))
        with connect(live) as fourth:  # room again
            fourth.sendall(post("/classify"))
            assert read_response(fourth)[0] == 200
        second.close()


def test_open_connections_are_counted_in_the_metrics(bundle_dir):
    """bertserve_open_connections counts client connections as they open and close, the
    figure to watch against BERTSERVE_MAX_CONNECTIONS (each scrape adds its own connection)."""
    with live_server(bundles=bundle_dir) as live:
        connections = live.server.server_state.connections
        asyncio.run(until(lambda: not connections))
        assert metric(live, "bertserve_open_connections") == 1
        socks = [connect(live) for _ in range(3)]
        asyncio.run(until(lambda: len(connections) == 3))
        assert metric(live, "bertserve_open_connections") == 4
        for sock in socks:
            sock.close()
        asyncio.run(until(lambda: not connections))
        assert metric(live, "bertserve_open_connections") == 1


def test_probes_and_metrics_pass_every_gate(bundle_dir):
    with live_server(bundles=bundle_dir, max_connections=1) as live:
        live.state.draining = True
        with connect(live) as sock:
            sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: t\r\n\r\n")
            assert read_response(sock)[0] == 200
            sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: t\r\n\r\n")
            assert read_response(sock)[0] == 200


def test_encode_writes_a_complete_response():
    raw = encode(NotReady("busy", retry_after_s=1), b"abc")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 503 Service Unavailable"
    assert b"retry-after: 1" in head and b"x-request-id: abc" in head
    assert b"content-length: %d" % len(body) in head
    assert json.loads(body) == {"error": "busy", "error_type": "unavailable"}


def test_a_drain_answers_the_accept_queue_before_it_closes_the_listener(bundle_dir):
    """Connections the kernel accepted after the server stopped accepting (its accept queue)
    get the draining 503 and a clean close, not a reset; then the port is closed."""
    with live_server(bundles=bundle_dir, draining=True) as live:
        server = live.server
        server.state.draining = True
        loop = server._loop

        asyncio.run_coroutine_threadsafe(_call(server.stop_accepting), loop).result(10)
        queued = [connect(live) for _ in range(5)]  # complete in the kernel, not yet accepted
        for i, sock in enumerate(queued):
            sock.sendall(post("/classify", x_request_id=f"queued-{i}"))
        deadline = time.monotonic() + 30
        taken = asyncio.run_coroutine_threadsafe(server._take_backlog(deadline), loop).result(30)
        assert taken == 5
        for i, sock in enumerate(queued):
            status, headers, _ = read_response(sock)
            assert (status, headers["connection"]) == (503, "close")
            assert headers["x-request-id"] == f"queued-{i}"
            assert closed_by_server(sock)
            sock.close()
        with pytest.raises(ConnectionRefusedError):
            connect(live)


def test_a_storm_of_new_connections_is_accepted_in_a_few_loop_iterations(bundle_dir):
    """libuv accepts one connection per event-loop iteration, and a loaded loop's iteration
    takes milliseconds, so a storm of new connections waited seconds in the kernel's accept
    queue. Here the loop is held while 200 connections complete in the kernel, then every
    iteration is made to take 5 ms: they are accepted in a few iterations (one per iteration
    would need 200), and each is served."""
    n = 200
    with live_server(bundles=bundle_dir, draining=True) as live:
        server, loop = live.server, live.server._loop
        iterations, go, stop = [0], threading.Event(), threading.Event()

        def slow_iteration() -> None:  # scheduled again from itself: runs once an iteration
            go.wait(30)  # the first run holds the loop until every connection is queued
            iterations[0] += 1
            time.sleep(0.005)
            if not stop.is_set():
                loop.call_soon(slow_iteration)

        loop.call_soon_threadsafe(slow_iteration)
        socks = []
        try:
            socks += [connect(live) for _ in range(n)]  # complete in the kernel, not accepted
            go.set()
            deadline = time.monotonic() + 30
            while len(server.server_state.connections) < n and time.monotonic() < deadline:
                time.sleep(0.001)
            used = iterations[0]
            stop.set()
            assert len(server.server_state.connections) == n
            assert used < n // 4, f"{used} loop iterations to accept {n} connections"
            for i, sock in enumerate(socks):
                sock.sendall(post("/classify", x_request_id=f"storm-{i}"))
                status, headers, _ = read_response(sock)
                assert (status, headers["x-request-id"]) == (200, f"storm-{i}")
        finally:
            go.set()
            stop.set()
            for sock in socks:
                sock.close()


def test_an_accept_that_fails_for_want_of_descriptors_steps_aside_and_comes_back(
    bundle_dir, monkeypatch
):
    """accept() failing with EMFILE leaves the socket ready, so retrying at once would spin the
    loop: the acceptor stops watching for ACCEPT_BACKOFF_S (libuv's own accept still serves),
    then watches again."""
    monkeypatch.setattr(server_module, "ACCEPT_BACKOFF_S", 1.0)
    with live_server(bundles=bundle_dir, draining=True) as live:
        server = live.server
        (fd,) = server._accepting
        failures = []

        def no_descriptors(self):
            failures.append(1)
            raise OSError(errno.EMFILE, "Too many open files")

        with monkeypatch.context() as patch:
            patch.setattr(socket.socket, "accept", no_descriptors)
            with connect(live) as sock:
                sock.sendall(post("/classify", x_request_id="emfile"))
                status, headers, _ = read_response(sock)
                assert (status, headers["x-request-id"]) == (200, "emfile")
        assert failures  # the acceptor tried once ...
        assert fd not in server._accepting  # ... stepped aside ...
        deadline = time.monotonic() + 5
        while fd not in server._accepting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fd in server._accepting  # ... and came back
        assert len(failures) == 1
        with connect(live) as sock:
            sock.sendall(post("/classify"))
            assert read_response(sock)[0] == 200


@pytest.mark.parametrize(
    ("waiting", "slot", "counts", "share"),
    [
        (5, None, None, 5),  # alone on the socket: all that waits
        (500, None, None, ACCEPT_BURST),  # at most a burst a wake-up
        (32, 0, [0, 0], 16),  # two idle workers split a burst of connections
        (16, 1, [16, 0], 16),  # the one behind takes what is left
        (10, 0, [40, 10], 0),  # the one ahead leaves them to the other
        (30, 0, [20, 10], 10),  # ... or takes only what brings it to its share
        (3, 2, [5, 5, 0], 3),  # a worker that replaced a dead one catches up
    ],
)
def test_a_worker_accepts_its_share_of_the_waiting_connections(waiting, slot, counts, share):
    assert accept_share(waiting, slot, counts) == share


def test_an_idle_connection_with_a_request_waiting_is_not_closed_by_the_keep_alive_timer(
    bundle_dir,
):
    """The loop may run the keep-alive timer before it reads a request already in the socket;
    closing then would reset that request. Simulated: reading paused, the request sent, the
    timer's handler run, reading resumed: the request is answered on the same connection."""
    with live_server(bundles=bundle_dir) as live:
        with connect(live) as sock:
            sock.sendall(post("/classify"))
            assert read_response(sock)[0] == 200
            (protocol,) = [
                p for p in live.server.server_state.connections if p.transport is not None
            ]
            loop = protocol.loop
            asyncio.run_coroutine_threadsafe(_call(protocol.transport.pause_reading), loop).result()
            sock.sendall(post("/classify", x_request_id="waiting"))
            time.sleep(0.2)  # in the kernel's buffer, unread
            asyncio.run_coroutine_threadsafe(
                _call(protocol.timeout_keep_alive_handler), loop
            ).result()
            assert not protocol.transport.is_closing()
            asyncio.run_coroutine_threadsafe(
                _call(protocol.transport.resume_reading), loop
            ).result()
            status, headers, _ = read_response(sock)
            assert status == 200 and headers["x-request-id"] == "waiting"
        # With nothing waiting, the timer still closes an idle connection.
        with connect(live) as sock:
            sock.sendall(post("/classify"))
            assert read_response(sock)[0] == 200
            asyncio.run(until(lambda: len(live.server.server_state.connections) == 1))
            (protocol,) = list(live.server.server_state.connections)
            asyncio.run_coroutine_threadsafe(
                _call(protocol.timeout_keep_alive_handler), protocol.loop
            ).result()
            assert closed_by_server(sock)


def test_a_connection_its_client_resets_leaves_no_keep_alive_timer_behind(bundle_dir):
    """uvicorn disarms an idle connection's keep-alive timer only when the connection closes
    cleanly: after a reset the timer fired on the closed socket, whose descriptor is -1, and
    the check for a waiting request raised ValueError (1,656 logged errors in one
    `make reliability`)."""
    import struct

    with live_server(bundles=bundle_dir) as live:
        sock = connect(live)
        sock.sendall(post("/classify"))
        assert read_response(sock)[0] == 200
        (protocol,) = [p for p in live.server.server_state.connections if p.transport is not None]
        assert protocol.timeout_keep_alive_task is not None  # idle, kept alive
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST, not FIN
        asyncio.run(until(lambda: protocol not in live.server.server_state.connections))
        assert protocol.timeout_keep_alive_task is None
        loop = protocol.loop
        waiting = asyncio.run_coroutine_threadsafe(_ask(protocol._request_waiting), loop).result()
        assert waiting is False  # a closed socket has nothing waiting, and asking does not raise


async def _ask(fn):
    return fn()


async def _call(fn) -> None:
    fn()


@pytest.mark.parametrize("refused", [False, True], ids=["answered", "refused"])
def test_an_idle_connection_is_closed_after_keep_alive_s_and_not_before(bundle_dir, refused):
    """The server's idle timeout is a setting (uvicorn's fixed 5 s raced clients that reused a
    connection as it closed: the request was reset unanswered). A connection stays usable
    inside it, after an answer from the app and after a refusal by the protocol alike, and is
    closed once it has been idle that long."""
    keep_alive = 0.6
    limits = {"max_in_flight": 1, "max_queued_batches": 0} if refused else {}
    with (
        live_server(bundles=bundle_dir, keep_alive_s=keep_alive, **limits) as live,
        one_request_held(live) if refused else contextlib.nullcontext(),
    ):
        expected = 503 if refused else 200
        with connect(live) as sock:
            for _ in range(2):  # reused within the timeout: still open, still answered
                sock.sendall(post("/classify"))
                assert read_response(sock)[0] == expected
                time.sleep(keep_alive / 2)
            sock.sendall(post("/classify"))
            assert read_response(sock)[0] == expected
            idle_from = time.monotonic()
            assert closed_by_server(sock)
            assert keep_alive * 0.8 <= time.monotonic() - idle_from <= keep_alive + 2


def test_an_overload_refusal_is_answered_after_the_refusal_delay_in_order(bundle_dir):
    """A client that retries at once cannot make refusals most of the server's work: an
    overload refusal waits `refusal_delay_ms` before it is written. A request pipelined behind
    a held refusal releases it at once, so answers keep their order; a drain answers a held
    refusal before it closes the connection."""
    delay = 0.4
    with (
        live_server(
            bundles=bundle_dir, max_in_flight=1, max_queued_batches=0, refusal_delay_ms=delay * 1000
        ) as live,
        one_request_held(live),
    ):
        with connect(live) as sock:
            sent = time.monotonic()
            sock.sendall(post("/classify", x_request_id="r1"))
            status, headers, _ = read_response(sock)
            assert status == 503 and headers["x-request-id"] == "r1"
            assert delay * 0.9 <= time.monotonic() - sent <= delay + 2

            sent = time.monotonic()  # two in one write: the first released by the second
            probe = b"GET /health/live HTTP/1.1\r\nhost: test\r\n\r\n"
            sock.sendall(post("/classify", x_request_id="p1") + probe)
            time.sleep(0.1)  # both answers in the socket before it is read, as CI's were
            (status, headers, _), (probed, _, _) = read_responses(sock, 2)
            assert status == 503 and headers["x-request-id"] == "p1"
            assert probed == 200  # the probe, after it
            assert time.monotonic() - sent < delay * 0.75

        with connect(live) as sock:  # draining: held, then answered before the close
            sock.sendall(post("/classify", x_request_id="d1"))
            asyncio.run(until(lambda: any(p._held for p in live.server.server_state.connections)))
            (protocol,) = [p for p in live.server.server_state.connections if p._held]
            sent = time.monotonic()
            asyncio.run_coroutine_threadsafe(_call(protocol.shutdown), protocol.loop).result()
            status, headers, _ = read_response(sock)
            assert status == 503 and headers["x-request-id"] == "d1"
            assert time.monotonic() - sent < delay * 0.75
            assert closed_by_server(sock)


class RecordingTransport:
    """A connection's transport that records each write, and passes everything through."""

    def __init__(self, transport, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def test_a_response_goes_out_in_one_write(bundle_dir):
    """Status line, headers and body in one write: one segment and one wake-up of the client,
    where uvicorn writes the head and the body apart."""
    with live_server(bundles=bundle_dir) as live:
        connections = live.server.server_state.connections
        asyncio.run(until(lambda: not connections))
        writes: list[bytes] = []
        with connect(live) as sock:
            asyncio.run(until(lambda: len(connections) == 1))
            protocol = next(iter(connections))
            protocol.transport = RecordingTransport(protocol.transport, writes)
            sock.sendall(post("/classify") + post("/nope"))  # and one pipelined behind it
            (status, _, body), (missing, _, _) = read_responses(sock, 2)
    assert status == 200 and json.loads(body)[0]["label"] and missing == 404
    assert len(writes) == 2
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(body)


def test_expect_100_continue_is_answered_before_the_body_is_sent(bundle_dir):
    with live_server(bundles=bundle_dir) as live, connect(live) as sock:
        request = post("/classify", expect="100-continue")
        head, _, body = request.partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += sock.recv(1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        status, _, answer = read_response(sock)
        assert status == 200 and json.loads(answer)[0]["label"]


def test_the_private_uvicorn_hooks_the_protocol_uses_are_there():
    """service/http/protocol.py subclasses uvicorn's private HttpToolsProtocol and
    RequestResponseCycle: a uvicorn or httptools release that renames a hook it overrides or an
    attribute it reads breaks it quietly. This names what changed."""
    import inspect

    import httptools
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    pinned = "service/http/protocol.py was written against uvicorn 0.54 and httptools 0.9"
    assert uvicorn.__version__.startswith("0.54."), f"{pinned}; uvicorn {uvicorn.__version__}"
    assert httptools.__version__.startswith("0.9."), f"{pinned}; httptools {httptools.__version__}"
    for method in (
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "timeout_keep_alive_handler",
        "shutdown",
        "_start_asgi_task",  # every dispatch, the pipelined ones' too: where those meet the gate
    ):
        assert callable(getattr(HttpToolsProtocol, method, None)), f"{pinned}: no {method}"
    protocol = inspect.getsource(HttpToolsProtocol)
    for attribute in ("cycle", "parser", "headers", "connections", "url", "loop", "transport"):
        assert f"self.{attribute} =" in protocol or f"self.{attribute}:" in protocol, (
            f"{pinned}: HttpToolsProtocol sets no self.{attribute}"
        )
    for attribute in ("timeout_keep_alive_task", "timeout_keep_alive"):
        assert f"self.{attribute} =" in protocol, f"{pinned}: no self.{attribute}"
    cycle = inspect.getsource(RequestResponseCycle.__init__)
    for attribute in ("self.transport", "self.response_started", "self.response_complete"):
        assert attribute in cycle, f"{pinned}: RequestResponseCycle sets no {attribute}"
    assert inspect.iscoroutinefunction(RequestResponseCycle.send), f"{pinned}: send changed"


def test_sigterm_during_start_up_ends_the_process(bundle_dir):
    """A worker that gets SIGTERM while it is still starting (a successor started just before
    the service is stopped) has accepted nothing: its drain must end it, not raise. Before,
    the drain reached for listeners start-up had not made yet, failed, and the process served
    on until its supervisor was killed."""
    from bertserve.service.http.app import create_app
    from bertserve.service.process.server import DrainingServer, uvicorn_config
    from bertserve.service.settings import Settings

    settings = Settings(bundles=bundle_dir, port=0, intra_op_threads=1)
    app = create_app(settings)
    server = DrainingServer(uvicorn_config(app, settings), app.state.service, 1.0)

    async def drain_before_start() -> None:
        server._loop = asyncio.get_running_loop()
        await server._drain()

    asyncio.run(drain_before_start())
    assert server.should_exit


def test_the_disconnect_comes_from_the_protocol_or_from_watching_receive():
    """Under bertserve's protocol a request gets its connection's future; under any other ASGI
    server, a watch of `receive` that ends at "http.disconnect" and then cancels the rows."""

    async def run():
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        scope = {"type": "http", "extensions": {CONNECTION_LOST: {"future": lost}}}
        assert disconnect_watch(scope, None) is lost
        messages: asyncio.Queue = asyncio.Queue()
        watch = disconnect_watch({"type": "http"}, messages.get)
        rows = [loop.create_future()]
        waiting = asyncio.ensure_future(gather(rows, asyncio.ensure_future(watch())))
        await messages.put({"type": "http.request", "body": b""})  # not a disconnect
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await messages.put({"type": "http.disconnect"})
        with pytest.raises(ClientGone):
            await waiting
        return rows

    assert asyncio.run(run())[0].cancelled()


def test_past_the_cap_a_client_batch_waits_and_one_input_is_refused_after_the_delay(bundle_dir):
    """With every in-flight slot taken, a task request's body is read: a client batch waits
    in the bulk lane and is answered; a request of one input is refused 503 with Retry-After,
    after refusal_delay_ms, and none of its rows reaches the model. Past max_queued_batches
    the protocol refuses at the headers again."""
    delay = 0.3
    pair = json.dumps({"inputs": ["a good film", "a bad film"]}).encode()
    with live_server(
        bundles=bundle_dir,
        max_in_flight=1,
        max_queued_batches=1,
        refusal_delay_ms=delay * 1000,
        queue_min_body_bytes=0,  # every task request may wait past the cap: read, then decided
    ) as live:
        batch = connect(live)
        try:
            with one_request_held(live):
                rows = metric(live, "bertserve_batch_rows_sum", model="sentiment")
                with connect(live) as single, connect(live) as third:
                    sent = time.monotonic()
                    single.sendall(post("/classify"))
                    status, headers, body = read_response(single)
                    assert status == 503 and headers["retry-after"] == "1"
                    assert "in flight (the limit)" in json.loads(body)["error"]
                    assert delay * 0.9 <= time.monotonic() - sent
                    batch.sendall(post("/classify", pair))
                    asyncio.run(until(lambda: live.state.queued == 1))
                    third.sendall(post("/classify", pair))
                    assert read_response(third)[0] == 503  # the one queued place is taken
                    assert live.state.queued == 1
            status, _, body = read_response(batch)
            assert status == 200 and len(json.loads(body)) == 2
        finally:
            batch.close()
        asyncio.run(until(lambda: live.state.queued == 0 and live.state.in_flight == 0))
        # after the held request's row: the batch's two; the refused single's none
        assert metric(live, "bertserve_batch_rows_sum", model="sentiment") - rows == 2


def test_a_client_batch_its_lane_cannot_take_is_refused_before_its_work(bundle_dir):
    """The bulk lane holds 4 rows, 3 of them a waiting batch's: another batch of 3 is answered
    429 before it is tokenised, after refusal_delay_ms, with Retry-After."""
    delay = 0.2
    three = json.dumps({"inputs": ["a", "b", "c"]}).encode()
    with live_server(
        bundles=bundle_dir, max_in_flight=3, max_bulk_queue_rows=4, refusal_delay_ms=delay * 1000
    ) as live:
        waiting = connect(live)
        try:
            with one_request_held(live):
                waiting.sendall(post("/classify", three))  # its 3 rows wait in the lane
                asyncio.run(until(lambda: live.state.queued == 1))
                with connect(live) as full:
                    sent = time.monotonic()
                    full.sendall(post("/classify", three))
                    status, headers, body = read_response(full)
                    assert status == 429 and headers["retry-after"] == "1", body
                    assert "client-batch sequences queued" in json.loads(body)["error"]
                    assert time.monotonic() - sent >= delay * 0.9
            assert read_response(waiting)[0] == 200
        finally:
            waiting.close()


def test_past_the_cap_a_body_over_max_queued_bytes_gets_no_place(bundle_dir):
    pair = json.dumps({"inputs": ["a good film " * 40, "b"]}).encode()
    with (
        live_server(bundles=bundle_dir, max_in_flight=1, max_queued_bytes=len(pair) - 1) as live,
        one_request_held(live),
        connect(live) as large,
    ):
        large.sendall(post("/classify", pair))
        assert read_response(large)[0] == 503
        assert live.state.queued == 0 and live.state.queued_bytes == 0


def test_a_transfer_coding_besides_chunked_is_refused_501(bundle_dir):
    """`Transfer-Encoding: gzip, chunked` was read as plain chunked and its compressed bytes
    parsed as JSON; a coding the server does not undo is a 501 (RFC 9112), naming it, and the
    connection serves the next request. Plain chunked framing is read as before."""
    body = b'{"inputs": "a fine film"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    answers = []
    with live_server(bundles=bundle_dir) as live, connect(live) as sock:
        for coding in (b"gzip, chunked", b"chunked"):
            sock.sendall(
                b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: " + coding + b"\r\n\r\n" + chunked
            )
            answers.append(read_response(sock))
    (refused, _, message), (served, _, labels) = answers
    assert refused == 501 and b"Transfer-Encoding gzip is not supported" in message
    assert served == 200 and json.loads(labels)[0]["label"]


@pytest.mark.parametrize(
    "head",
    [
        b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n",
        b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n",
        b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 5\r\n",
        b"POST /classify?\xff HTTP/1.1\r\nHost: x\r\n",
    ],
)
def test_http_the_parser_cannot_read_gets_the_services_error_shape(bundle_dir, head):
    """uvicorn answered unreadable HTTP (two Content-Lengths, a negative one, both framings,
    bytes a request line may not hold) with a plain-text 400 and no X-Request-ID: it is a
    JSON 400 with an error_type and an id, and the connection ends."""
    with live_server(bundles=bundle_dir) as live, connect(live) as sock:
        sock.sendall(head + b"X-Request-ID: bad-frame-1\r\n\r\n{}\r\n")
        status, headers, body = read_response(sock)
        assert status == 400, body
        assert headers["content-type"] == "application/json"
        assert headers["connection"] == "close" and headers["x-request-id"]
        assert json.loads(body)["error_type"] == "bad_request"
        assert "not HTTP/1.1 the server can read" in json.loads(body)["error"]


def test_a_body_must_keep_up_the_minimum_rate(bundle_dir, monkeypatch):
    """A client that sends a body a byte now and then held a receiving slot for the whole body
    timeout (600 of them kept every other client out): past the grace, a body must keep up
    BERTSERVE_BODY_MIN_RATE, else 408 and close. A body that keeps up is read whole."""
    import time

    from bertserve.service.http import app as app_module

    monkeypatch.setattr(app_module, "BODY_GRACE_S", 0.3)
    body = json.dumps({"inputs": "a fine film " * 15}).encode()  # 200 bytes
    head = (
        b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with live_server(bundles=bundle_dir, body_min_rate=100, body_timeout_s=20) as live:
        with connect(live) as sock:
            started = time.monotonic()
            sock.sendall(head + body[:1])
            status, headers, answer = read_response(sock)
            assert status == 408 and headers["connection"] == "close"
            assert "slower than 100 bytes/s" in json.loads(answer)["error"]
            assert time.monotonic() - started < 5  # not the 20 s body timeout
        with connect(live) as sock:
            sock.sendall(head)
            for i in range(0, len(body), 20):  # 200 bytes/s: twice the minimum
                sock.sendall(body[i : i + 20])
                time.sleep(0.1)
            status, _, answer = read_response(sock)
            assert status == 200, answer
