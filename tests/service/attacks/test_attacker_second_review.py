"""The second adversarial review (issue: "No way to take the service down"), finding by finding:
each attack is reproduced over real HTTP against the real engine, and each test asserts the
bound that answers it (docs/security.md#second-review). Each fails on the code the review
ran (4942628)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from bertserve.runtime.batching import LoneCost
from tests.helpers.server import host_port, live_server, probe_live_while, rss_mb

pytestmark = pytest.mark.slow
KEY = "second-review-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir, api_keys=KEY, max_in_flight=16) as live:
        yield live


# --- 1. chunked trailers: unbounded in size and time, joined quadratically -----------------------


CHUNKED = b"POST /classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"


def trailer_flood(host: str, port: int, sends: int = 16, key: bool = False) -> bytes:
    """The review's attack: a one-chunk body, then a trailer that never ends (without a key,
    or with one). What the server answered before it closed the connection."""
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n" if key else b""
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(CHUNKED + auth + b"\r\n2\r\n{}\r\n0\r\nX-Pad: ")
        try:
            for _ in range(sends):
                s.sendall(b"a" * 65536)
        except OSError:  # closed on us: what should happen
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    return answer


def test_trailers_count_against_the_header_limit(server):
    """Before: 16 connections sending trailers for 25-40 s grew each worker by 400-550 MB and
    held /health/live for 14-28 s. Now the framing after the last chunk gets the header limit:
    past 32 kB the connection is closed, and memory does not grow."""
    host, port = host_port(server)
    before = rss_mb()
    answers: list[bytes] = []
    keyed: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: answers.append(trailer_flood(host, port)))
        for _ in range(12)
    ] + [
        threading.Thread(target=lambda: keyed.append(trailer_flood(host, port, key=True)))
        for _ in range(4)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    with server.client(headers=AUTH) as c:
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert c.post("/classify", json={"inputs": "fine"}).status_code == 200
            assert time.perf_counter() - t0 < 2
    for t in threads:
        t.join()
    assert time.monotonic() - started < 10
    assert len(answers) == 12 and len(keyed) == 4
    # Without a key the 401 may come first (it is answered before the body ends): then the
    # connection just ends. With one, the request waits for its body: 431.
    assert all(b" 431 " in a or a.startswith(b"HTTP/1.1 401") for a in answers), answers[:2]
    assert all(a.startswith(b"HTTP/1.1 431") for a in keyed), keyed[:2]
    assert b"trailers are over 32,768 bytes" in keyed[0]
    assert rss_mb() - before < 100


def test_an_upload_in_tiny_chunks_is_served(server):
    """A streaming client's one-byte chunks: a read is four parts framing to one of data,
    and none of that counts; only reads wholly after a size line do."""
    host, port = host_port(server)
    body = json.dumps({"inputs": "a fine film " * 3000, "parameters": {"truncation": True}})
    framed = b"".join(b"1\r\n%s\r\n" % bytes([c]) for c in body.encode())
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(CHUNKED + auth + b"Content-Type: application/json\r\n\r\n")
        for i in range(0, len(framed), 60_000):
            s.sendall(framed[i : i + 60_000])
        s.sendall(b"0\r\n\r\n")
        answer = s.recv(65536)
    assert len(framed) > 4 * 32_768
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_slow_trailers_time_out_like_headers(bundle_dir):
    with live_server(bundles=bundle_dir, header_timeout_s=0.5) as live:
        host, port = host_port(live)
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(CHUNKED + b"\r\n2\r\n{}\r\n0\r\nX-Pad: a")
            started = time.monotonic()
            answer = s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            assert b"trailers did not arrive within 0.5 s" in answer
            assert 0.4 < time.monotonic() - started < 3
            assert s.recv(4096) == b""  # closed


def test_a_pause_after_a_data_chunks_size_line_is_not_a_trailer_timeout(bundle_dir):
    """The review's finding: the trailer timer was armed at every chunk's size line, so an
    upload pausing past header_timeout right after one (its data still to come) got a false
    408. Only the last chunk's counts; the body timeout bounds the rest."""
    body = json.dumps({"inputs": "a fine film"}).encode()
    with live_server(bundles=bundle_dir, header_timeout_s=0.5) as live:
        host, port = host_port(live)
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(CHUNKED + b"Content-Type: application/json\r\n\r\n")
            s.sendall(b"3\r\n" + body[:3] + b"\r\n")
            s.sendall(b"%x;ext=1\r\n" % (len(body) - 3))  # a size line, then a pause
            time.sleep(1.5)
            s.sendall(body[3:] + b"\r\n0\r\n\r\n")
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        with socket.create_connection((host, port), timeout=10) as s:  # the last one's counts
            s.sendall(CHUNKED + b"\r\n%x\r\n%s\r\n0\r\n" % (len(body), body))
            started = time.monotonic()
            answer = s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            assert b"trailers did not arrive within 0.5 s" in answer
            assert time.monotonic() - started < 3


def test_chunked_bodies_with_trailers_and_large_chunks_are_served(server):
    """The bound counts framing, not data: a 92 kB body in chunks of every size, and a short
    trailer section, are answered; so is the next request on the same connection."""
    host, port = host_port(server)
    text = "a fine and moving film " * 4000
    body = json.dumps({"inputs": text, "parameters": {"truncation": True}}).encode()
    pieces = [body[:1], body[1:70_000], body[70_000:]]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(CHUNKED + auth + b"Content-Type: application/json\r\n\r\n")
        for i in range(0, len(framed), 1000):  # one size line may straddle two reads
            s.sendall(framed[i : i + 1000])
            time.sleep(0.0005)
        s.sendall(b"0\r\nX-Checksum: abc\r\n\r\n")
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        small = json.dumps({"inputs": "fine"}).encode()
        s.sendall(
            CHUNKED
            + auth
            + b"Content-Type: application/json\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(small), small)
        )
        again = s.recv(65536)
        assert again.startswith(b"HTTP/1.1 200"), again[:300]
    with httpx.Client() as c:
        assert c.get(f"{server.url}/health/live").status_code == 200


# --- 5. the lone path ran heavy calls on the event loop ----------------------------------------


class SlowLone:
    """The model, with every lone-session call made `seconds` slower: the review's 400-700 ms
    calls (126 [MASK]s, a long /embed on its CPU), on any machine (a fault injected)."""

    def __init__(self, engine, seconds: float) -> None:
        self.engine, self.seconds = engine, seconds
        self.runs_alone = engine.runs_alone

    def run(self, feeds, alone=False):
        if alone:
            time.sleep(self.seconds)
        return self.engine.run(feeds, alone=alone)


def test_heavy_lone_requests_leave_liveness_prompt(bundle_dir):
    """Before: heavy lone calls ran on the loop's thread, back to back, and held /health/live
    up to 624 ms. Now a lone call measured (or not yet measured) heavier than
    LoneCost.INLINE_S runs on the model's thread, still on the lone session."""
    with live_server(bundles=bundle_dir, lone_threads=2) as live:
        batcher = live.state.models["sentiment"].batcher
        assert batcher.backend.runs_alone
        batcher.backend = SlowLone(batcher.backend, 0.15)
        batcher.lone_cost = LoneCost()  # the warm-up measured the model before it was slowed

        def work() -> list[int]:
            with live.client() as c:
                return [c.post("/classify", json={"inputs": "fine"}).status_code for _ in range(8)]

        latencies, statuses = probe_live_while(live, work)
        with live.client() as c:
            lone = c.get("/metrics").text
    assert statuses == [200] * 8
    assert 'bertserve_lone_calls_total{model="sentiment"} 8.0' in lone  # on the lone session
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.05 and latencies[-1] < 0.1, (p99, latencies[-3:])


# --- 4. slow bodies held in-flight slots ---------------------------------------------------------


def test_slow_bodies_hold_no_in_flight_slot(server):
    """Before: a request took its in-flight slot at its headers, and 64 keyed connections
    trickling their bodies locked other keyed users out (52 x 503, the first 200 after 29 s).
    Now the slot is taken once the body is complete: twice the cap of slow bodies waits, the
    others are served at once, and the slow ones are answered when their bodies end (200, or
    503 for a body that completes when every slot is taken)."""
    host, port = host_port(server)
    body = json.dumps({"inputs": "fine"}).encode()
    head = (
        b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    slow = [socket.create_connection((host, port), timeout=10) for _ in range(32)]  # cap 16
    try:
        for s in slow:
            s.sendall(head + body[:1])
        time.sleep(0.2)
        with server.client(headers=AUTH) as c:
            for _ in range(5):
                started = time.perf_counter()
                response = c.post("/classify", json={"inputs": "fine"})
                assert response.status_code == 200, response.text
                assert time.perf_counter() - started < 2
            metrics = c.get("/metrics").text
        assert "bertserve_in_flight_requests 0.0" in metrics
        for s in slow:
            s.sendall(body[1:])
        answers = [s.recv(65536) for s in slow]
    finally:
        for s in slow:
            s.close()
    statuses = [a.split(b" ", 2)[1] for a in answers]
    assert set(statuses) <= {b"200", b"503"} and statuses.count(b"200") >= 16, statuses
    assert all(b"retry-after: 1" in a.lower() for a in answers if b" 503 " in a[:16])


def test_the_drain_waits_for_an_admitted_body(bundle_dir):
    """A request admitted before SIGTERM whose body is still arriving holds no in-flight slot,
    but it was admitted: the drain waits for it, and it is answered."""
    with live_server(bundles=bundle_dir, draining=True, drain_timeout_s=10) as live:
        host, port = host_port(live)
        body = json.dumps({"inputs": "fine"}).encode()
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(
                b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body[:1]
            )
            time.sleep(0.2)
            assert live.state.receiving == 1 and live.state.in_flight == 0
            live.server.handle_exit(signal.SIGTERM, None)
            time.sleep(0.5)
            assert live.server.started and not live.server.should_exit
            s.sendall(body[1:])
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# --- 7. /metrics rendered on the loop; a changed model file refused late ------------------------


def test_scrapes_cannot_move_liveness(bundle_dir):
    """Before: four clients scraping /metrics in a loop moved /health/live's p50 from 2 to
    14 ms and its max to 351 ms (the first scrape took 128 ms on the loop). Now a scrape is
    made on a thread, once for every scraper waiting for it: a collection slowed to 200 ms
    (a fault injected) leaves the loop free."""
    with live_server(bundles=bundle_dir, metrics_cache_s=0.0) as live:
        metrics = live.state.metrics
        real, renders = metrics.exposition, []

        def slow() -> bytes:
            renders.append(1)
            time.sleep(0.2)
            return real()

        metrics.exposition = slow
        stop = threading.Event()
        scrapes: list[int] = []

        def scrape() -> None:
            with live.client() as c:
                while not stop.is_set():
                    response = c.get("/metrics")
                    assert b"bertserve_requests_total" in response.content
                    scrapes.append(response.status_code)

        scrapers = [threading.Thread(target=scrape) for _ in range(4)]
        for t in scrapers:
            t.start()
        latencies, _ = probe_live_while(live, lambda: time.sleep(1.5))
        stop.set()
        for t in scrapers:
            t.join()
    assert scrapes and set(scrapes) == {200}
    assert len(renders) < len(scrapes)  # scrapes that came while one was made shared it
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.01 and latencies[-1] < 0.1, latencies[-3:]


def test_a_body_that_completes_when_every_slot_is_taken_is_refused(server):
    """The cap holds: a request admitted at its headers whose body completes when every
    in-flight slot is taken gets 503 with Retry-After, and runs nothing."""
    from bertserve.service.state import Slot

    host, port = host_port(server)
    body = json.dumps({"inputs": "fine"}).encode()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body[:1]
        )
        time.sleep(0.2)
        state = server.state
        held = [Slot(state) for _ in range(state.settings.max_in_flight)]
        for slot in held:
            slot.take()
        try:
            assert state.in_flight == state.settings.max_in_flight
            s.sendall(body[1:])
            answer = s.recv(65536)
        finally:
            for slot in held:
                slot.release()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"requests in flight (the limit)" in answer and b"retry-after: 1" in answer.lower()
    assert state.in_flight == 0 and state.receiving == 0


def test_bodies_arriving_at_once_are_bounded(bundle_dir):
    """Bodies hold no in-flight slot while they arrive, so they are bounded on their own
    (max_receiving): past it a request is refused at its headers, before its body is read."""
    with live_server(bundles=bundle_dir, max_receiving=4) as live:
        host, port = host_port(live)
        head = (
            b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        slow = [socket.create_connection((host, port), timeout=10) for _ in range(4)]
        try:
            for s in slow:
                s.sendall(head)
            time.sleep(0.2)
            assert live.state.receiving == 4
            with live.client() as c:
                response = c.post("/classify", json={"inputs": "fine"})
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert "4 requests are sending their bodies (the limit)" in response.text
        finally:
            for s in slow:
                s.close()
        time.sleep(0.2)
        assert live.state.receiving == 0
        with live.client() as c:
            assert c.post("/classify", json={"inputs": "fine"}).status_code == 200
