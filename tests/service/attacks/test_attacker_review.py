"""The adversarial review of `make serve` with an API key set, finding by finding: each attack
is reproduced over real HTTP against the real engine, and each test asserts the bound that
answers it (docs/security.md#the-bounds-measured). All but the two `targets` limits, which
already held, fail on the code the review ran (6a01d94)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.helpers.server import (
    assert_prompt,
    host_port,
    live_server,
    probe_live_while,
    rss_mb,
)

pytestmark = pytest.mark.slow
KEY = "attacker-review-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir, api_keys=KEY, max_in_flight=16) as live:
        yield live


def post(server, path, body):
    data = json.dumps(body).encode()
    with server.client(headers={**AUTH, "content-type": "application/json"}) as c:
        started = time.perf_counter()
        response = c.post(path, content=data)
        return response, time.perf_counter() - started


# --- 1. memory: one pair request grew a worker by 1.2-1.6 GB -------------------------------------


def test_truncated_pair_costs_linear_memory_and_time(server):
    """Before: tokenizers' longest_first built 16,509 overflow encodings for this 16 kB body:
    3 s and +1.2-1.6 GB for good (200 kB: 22.8 GB, the OOM killer)."""
    body = {
        "inputs": {"text": "a." * 4000, "text_pair": "a." * 4000},
        "parameters": {"truncation": True},
    }
    before = rss_mb()
    response, elapsed = post(server, "/nsp", body)
    assert response.status_code == 200, response.text
    assert rss_mb() - before < 200
    assert elapsed < 1.0
    body["inputs"] = {"text": "a." * 50_000, "text_pair": "b." * 50_000}  # 200 kB
    response, elapsed = post(server, "/nsp", body)
    assert response.status_code == 200, response.text
    assert rss_mb() - before < 200


# --- 2. unauthenticated traffic must not take what keyed traffic needs --------------------------


def test_bodiless_probes_that_never_send_their_body_hold_no_slot(server):
    """Before: 140 connections sending `GET /health/live` with Content-Length: 100 and no body
    held every in-flight slot for 30 s: keyed requests got 503."""
    host, port = host_port(server)
    sockets = []
    try:
        for _ in range(3 * server.state.settings.max_in_flight):
            s = socket.create_connection((host, port))
            s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            sockets.append(s)
        time.sleep(0.3)
        assert server.state.in_flight == 0
        response, _ = post(server, "/classify", {"inputs": "fine"})
        assert response.status_code == 200, response.text
    finally:
        for s in sockets:
            s.close()


def test_idle_anonymous_connections_cannot_fill_the_connection_cap(bundle_dir):
    """Before: idle keep-alive connections without a key filled the per-process cap, and keyed
    requests on new connections got 503. Now the oldest idle anonymous ones are closed."""
    with live_server(
        bundles=bundle_dir, api_keys=KEY, max_connections=24, max_anonymous_connections=8
    ) as live:
        host, port = host_port(live)
        idle = []
        try:
            for _ in range(40):  # anonymous, kept alive after a public answer
                s = socket.create_connection((host, port))
                s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                s.recv(4096)
                idle.append(s)
            time.sleep(0.2)
            assert len(live.server.server_state.connections) <= 10
            with live.client(headers=AUTH) as c:
                for _ in range(3):
                    assert c.post("/classify", json={"inputs": "fine"}).status_code == 200
        finally:
            for s in idle:
                s.close()


def test_oversized_headers_get_431_before_they_are_buffered(server):
    """Before: one 100 MB header was read whole (8.6 s, +430 MB for four)."""
    host, port = host_port(server)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        started = time.monotonic()
        answer = b""
        try:
            for _ in range(200):  # 200 x 64 kB, far past the 32 kB limit
                s.sendall(b"a" * 65536)
        except OSError:  # closed on us: what should happen
            pass
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert time.monotonic() - started < 1


def test_metrics_scrapes_are_reused_and_can_ask_for_a_token(bundle_dir):
    """Before: each scrape cost ~15 ms of the loop, and eight looping scrapers pushed
    /classify's p50 to 403 ms. Now a scrape is reused for metrics_cache_s; with a
    metrics_token, /metrics asks for it (and the API key does not open it)."""
    token = "metrics-token-0123456789abcdef"
    with (
        live_server(
            bundles=bundle_dir, api_keys=KEY, metrics_token=token, metrics_cache_s=30
        ) as live,
        live.client() as c,
    ):
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=AUTH).status_code == 401
        scrape = {"authorization": f"Bearer {token}"}
        first = c.get("/metrics", headers=scrape).text
        assert c.post("/classify", json={"inputs": "x"}, headers=AUTH).status_code == 200
        assert c.get("/metrics", headers=scrape).text == first  # from the cache


def test_refusals_wait_their_delay_with_connection_close_too(bundle_dir):
    """Before: `Connection: close` skipped the 50 ms refusal delay (~1,300 refusals a second
    from four threads)."""
    with live_server(bundles=bundle_dir, max_in_flight=1, refusal_delay_ms=200) as live:
        live.state.in_flight = 1  # full: every task request is refused
        try:
            with live.client() as c:
                started = time.perf_counter()
                response = c.post(
                    "/classify", json={"inputs": "x"}, headers={"connection": "close"}
                )
                elapsed = time.perf_counter() - started
        finally:
            live.state.in_flight = 0
    assert response.status_code == 503
    assert elapsed >= 0.2


def test_two_authorization_headers_are_refused(server):
    """Before: with two headers, the last one won (proxies may read the first)."""
    host, port = host_port(server)
    body = b'{"inputs": "x"}'
    head = (
        b"POST /classify HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer wrong-key-000000000000\r\n"
        b"authorization: Bearer " + KEY.encode() + b"\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(head + body)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]
    assert b"one Authorization header" in answer


def test_head_on_the_probes_is_answered(server):
    with httpx.Client(base_url=server.url) as c:
        assert c.head("/health/live").status_code == 200
        assert c.head("/health/ready").status_code == 200


# --- 3-5. CPU: every step bounded and off the event loop -------------------------------------


def test_qa_with_the_heaviest_parameters_keeps_the_loop_free(server):
    """Before: a 4 kB context with max_seq_len 58, doc_stride 27 and top_k 100 stayed under the
    4,096-character threshold and decoded on the event loop, with a quadratic merge. Distinct
    words make every candidate a new answer, the merge's worst case."""
    context = " ".join(f"w{i}" for i in range(650))  # 3.8 kB
    assert len(context) < 4096
    body = {
        "inputs": {"question": "which one ?", "context": context},
        "parameters": {"max_seq_len": 58, "doc_stride": 27, "top_k": 100, "max_answer_len": 512},
    }

    def twice():
        return [post(server, "/qa", body) for _ in range(2)][-1]

    latencies, (response, elapsed) = probe_live_while(server, twice)
    assert response.status_code == 200, response.text
    assert len(latencies) >= 3, elapsed
    assert_prompt(latencies, elapsed)


def test_qa_merge_is_linear_in_windows_times_candidates(bundle_dir):
    """Before: each candidate span scanned every answer kept so far: 61 windows at top_k 100
    took 20 s, 60 kB bodies 63 s. Distinct words in windows that do not overlap make every
    candidate a new answer: over 60 windows x 210 candidates, about 13,000 answers, which the
    old merge compared pair by pair (tens of seconds) and a dict merges in well under one."""
    import numpy as np

    from bertserve.runtime.batching import RowResult
    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.tasks import qa
    from bertserve.runtime.tasks.common import TaskContext

    bundle = bundle_dir / "squad"
    ctx = TaskContext.load(bundle, load_bundle_spec(bundle), 100_000, 64)
    words = " ".join(f"w{i}" for i in range(7500))
    inputs, rows = qa.preprocess(ctx, [("which ?", words)], 128, 0, 64)
    assert len(rows) >= 60
    rng = np.random.default_rng(0)
    results = [
        RowResult(
            {
                "start_logits": rng.normal(size=len(r)).astype(np.float32),
                "end_logits": rng.normal(size=len(r)).astype(np.float32),
            },
            0.0,
            0.0,
        )
        for r in rows
    ]
    started = time.perf_counter()
    answers = qa.postprocess(ctx, inputs, results, 100, 512, True)
    assert len(answers[0]) == 100
    assert time.perf_counter() - started < 3.0, len(rows)


def test_ner_counts_its_sequences_before_the_work(server):
    """Before: nine 100 kB texts cost 12.3 s of CPU and then a 413 (9,576 sequences)."""
    response, elapsed = post(server, "/ner", {"inputs": ["a." * 49_999] * 9})
    assert response.status_code == 413 and "sequences" in response.json()["error"]
    assert elapsed < 1.0


@pytest.mark.parametrize(
    ("path", "parameters", "field"),
    [
        ("/ner", {"ignore_labels": ["X"] * 190_000, "aggregation_strategy": "none"}, "ignore"),
        ("/ner", {"ignore_labels": ["X" * 1000]}, "ignore"),
        ("/fill-mask", {"targets": ["x" * 1000] * 1000}, "targets"),
        ("/fill-mask", {"targets": ["paris"] * 1001}, "targets"),
    ],
)
def test_parameter_lists_have_a_stated_maximum(server, path, parameters, field):
    """Before: a 190k-entry ignore_labels list took 2.6 s, 1 MB of targets 1.6 s and +330 MB."""
    inputs = "paris is the [MASK] of france ." if path == "/fill-mask" else "Paris"
    response, elapsed = post(server, path, {"inputs": inputs, "parameters": parameters})
    assert response.status_code in (413, 422), response.text
    assert elapsed < 0.5


def test_a_deadline_stops_post_processing():
    """The request timeout reaches into the tasks' loops: a check that has passed stops the
    next window, where the old code ran on and logged a 200."""
    from bertserve.runtime.tasks.common import checkpoint, deadline_check, unwatch, watch
    from bertserve.service.http.errors import ClientGone, DeadlineExceeded

    token = watch(deadline_check(time.monotonic() - 1, lambda: False))
    try:
        with pytest.raises(DeadlineExceeded):
            checkpoint()
    finally:
        unwatch(token)
    token = watch(deadline_check(time.monotonic() + 60, lambda: True))
    try:
        with pytest.raises(ClientGone):
            checkpoint()
    finally:
        unwatch(token)
    checkpoint()  # no request: evaluation runs the same loops unchecked


def test_a_client_that_leaves_is_logged_499_not_200(bundle_dir, caplog):
    """Before: a client that left during post-processing still cost its whole decode, and the
    log recorded a 200. Now the work stops at the next step and the access log says 499."""
    import logging

    from bertserve.runtime.tasks import TASKS

    ner = TASKS["/ner"]
    original = ner.finish

    def slow_finish(*args, **kwargs):
        time.sleep(0.5)  # the client times out meanwhile
        return original(*args, **kwargs)

    with live_server(bundles=bundle_dir, inline_cost=0) as live:
        ner.finish = slow_finish  # type: ignore[method-assign]
        try:
            with caplog.at_level(logging.INFO, logger="bertserve.access"):
                with (
                    pytest.raises(httpx.ReadTimeout),
                    httpx.Client(base_url=live.url, timeout=0.2) as c,
                ):
                    c.post("/ner", json={"inputs": "Paris"})
                time.sleep(0.8)
        finally:
            ner.finish = original  # type: ignore[method-assign]
    statuses = [r.fields["status"] for r in caplog.records if hasattr(r, "fields")]
    assert statuses[-1] == 499, statuses


def test_decoding_many_ids_keeps_the_loop_free(server):
    """Before: /decode ran on the event loop: 3.4 MB of ids took 0.23 s there, and ten such
    requests at once held /health/live for 1.8 s."""
    ids = [[50, 61, 72] * 33_000] * 7  # 2.8 MB
    body = {"ids": ids}

    def twice():
        return [post(server, "/decode", body) for _ in range(2)][-1]

    latencies, (response, elapsed) = probe_live_while(server, twice)
    assert response.status_code == 200, response.text
    assert len(response.json()) == 7
    assert len(latencies) >= 3, elapsed
    assert_prompt(latencies, elapsed)
