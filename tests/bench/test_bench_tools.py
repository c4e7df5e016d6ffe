"""The benchmark's own tools: the load generators count what the server answered, and the
transformers peer serves exactly the bundle's model."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
import threading

import numpy as np
import pytest

from bench.loadgen import closed_loop, open_loop
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow

TEXTS = ["a gripping, funny film", "dull", "it is far too long and nothing happens", "ok"]


@pytest.fixture(scope="module")
def bodies(tmp_path_factory):
    path = tmp_path_factory.mktemp("bodies") / "classify.jsonl"
    lines = [json.dumps({"inputs": t}) for t in TEXTS] + [json.dumps({"inputs": ""})]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir) as live:
        yield live


def requests_served(live) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with live.client() as c:
        text = c.get("/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "bertserve_requests_total" and s.labels["endpoint"] == "/classify"
    )


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_closed_loop_counts_every_answer_by_status(server, bodies):
    before = requests_served(server)
    result = closed_loop(f"{server.url}/classify", bodies, connections=4, seconds=1.5)
    # One body in five is empty: the service answers it 422, and wrk's Lua counts it as such.
    assert set(result.statuses) == {"200", "422"}
    assert result.statuses["422"] == pytest.approx(result.requests / 5, abs=5)
    assert result.errors == 0
    # wrk may stop with a few requests in flight: the server saw at least what wrk counted.
    assert result.requests <= requests_served(server) - before <= result.requests + 4
    assert 0 < result.p50_ms <= result.p95_ms <= result.p99_ms
    assert result.throughput == pytest.approx(result.statuses["200"] / result.seconds)
    assert 0 < result.client_cpu_s < result.seconds


def test_open_loop_keeps_its_schedule_and_counts_every_answer(server, bodies):
    before = requests_served(server)
    result = open_loop(f"{server.url}/classify", bodies, rate=100, seconds=2)
    sent = result.extra["sent"]
    assert 140 <= sent <= 260  # Poisson(200): far outside this only if the schedule is broken
    assert result.requests == sent and result.errors == 0 and result.extra["unsent"] == 0
    assert result.statuses["422"] == pytest.approx(sent / 5, abs=8)
    assert requests_served(server) - before == sent
    assert 0 < result.p50_ms <= result.p99_ms < 1000


def test_open_loop_sends_its_headers_on_every_request(bundle_dir, bodies):
    """bench tenants: each tenant's load carries its key. Against a keyed server, the keyed
    load is answered (200 and the bodies' 422) and the same load without the key is all 401."""
    key = "bench-loadgen-key-0123456789"
    with live_server(bundles=bundle_dir, api_keys=key) as live:
        url = f"{live.url}/classify"
        keyed = open_loop(url, bodies, 40, 1, headers={"Authorization": f"Bearer {key}"})
        bare = open_loop(url, bodies, 40, 1)
    assert set(keyed.statuses) == {"200", "422"} and keyed.errors == 0
    assert set(bare.statuses) == {"401"}


def test_transformers_peer_serves_the_bundles_own_weights(checkpoints, tmp_path):
    import torch
    from transformers import BertForSequenceClassification

    from bench.peers.common import OrtClassifier
    from bench.peers.hf_pipeline import build_pipeline, check_same_model
    from bertserve.export.bundle import build_bundle

    # Every weight distinct (a fresh model's LayerNorms are all ones, and ONNX Runtime shares
    # identical initialisers under one name), as in a trained model.
    source = checkpoints["BertForSequenceClassification"]
    model = BertForSequenceClassification.from_pretrained(source)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "vocab.txt").write_bytes((source / "vocab.txt").read_bytes())
    build_bundle(tmp_path / "ckpt", ["classify"], tmp_path / "bundle")
    bundle = tmp_path / "bundle"
    pipe = build_pipeline(bundle)
    assert check_same_model(pipe, bundle, TEXTS) < 1e-4
    ort = OrtClassifier(bundle)
    for text in TEXTS:
        expected = ort.answers(ort.logits([text]))[0]
        got = pipe(text)
        assert got[0]["label"] == expected[0]["label"]
        assert np.isclose(got[0]["score"], expected[0]["score"], atol=1e-5)


@pytest.mark.parametrize("task", ["ner", "fill-mask"])
def test_ab_serves_an_old_format_bundle_unchanged(task, checkpoints, tmp_path):
    """bench.ab gives this code the old code's own model files: a format-1 bundle.json becomes
    format 2 with the same model, and the axes the outputs have."""
    from bench.ab import as_format_2
    from bertserve.export.bundle import build_bundle
    from bertserve.runtime.bundle import check_model_file, load_bundle_spec

    arch = {"ner": "BertForTokenClassification", "fill-mask": "BertForPreTraining"}[task]
    current = build_bundle(checkpoints[arch], [task], tmp_path / "v2")
    old = tmp_path / "v1"
    shutil.copytree(tmp_path / "v2", old)
    v1 = json.loads((old / "bundle.json").read_text())
    for key in ("model_sha256", "output_axes", "pooling", "export_parity", "default"):
        v1.pop(key, None)
    (old / "bundle.json").write_text(json.dumps(v1 | {"format_version": 1}))

    as_format_2(old, tmp_path / "up")
    spec = load_bundle_spec(tmp_path / "up")
    check_model_file(tmp_path / "up", spec)
    assert spec.output_axes == current.output_axes
    assert spec.model_sha256 == current.model_sha256
    as_format_2(tmp_path / "v2", tmp_path / "same")  # a recent tree's bundle: copied as it is
    assert (tmp_path / "same" / "bundle.json").read_bytes() == (
        tmp_path / "v2" / "bundle.json"
    ).read_bytes()


def test_make_bench_serves_the_bundle_it_measures():
    """With every shipped bundle, /classify goes to the default (the MiniLM teacher): make bench
    measured the teacher over HTTP against the student's raw ceiling until it served only the
    bundle under test beside the other tasks' bundles. The transformers peer rebuilds torch
    weights from float32 initializers, so a quantised bundle skips it, saying why."""
    from pathlib import Path

    from bench.run import runnable_peers, served_bundles
    from bertserve.runtime.bundle import load_bundle_spec

    shipped = Path(__file__).resolve().parents[2] / "bundles"
    student = shipped / "sst2-distilled-2x192"
    served = served_bundles(shipped, student)
    assert served[0] == student.name
    classifiers = [n for n in served if "classify" in load_bundle_spec(shipped / n).tasks]
    assert classifiers == [student.name]
    assert {"ner", "qa", "fill-mask", "nsp"} <= {
        t for n in served for t in load_bundle_spec(shipped / n).tasks
    }
    peers, skipped = runnable_peers(["transformers", "fastapi-ort"], student)
    assert peers == ["fastapi-ort"]
    assert "needs an fp32 bundle" in skipped["transformers"]


def test_graph_ab_swaps_the_order_every_batch_and_takes_two_graphs_only(monkeypatch):
    """Which graph runs first alternates batch by batch (and pass by pass), so neither always
    follows the other: with three, the middle one always did, and measured 0.84x for it."""
    import sys

    from bench.experiments import graph_ab

    calls: list[tuple[int, int]] = []

    class Recording:  # stands in for an Engine to record the order of the calls
        def __init__(self, index: int) -> None:
            self.index = index

        def run(self, feeds: dict) -> None:
            calls.append((self.index, feeds["batch"]))

    batches = [{"batch": k} for k in range(3)]
    spent = graph_ab.interleaved([Recording(0), Recording(1)], batches, passes=2)
    assert len(spent) == 2 and all(len(p) == 2 for p in spent)
    timed = calls[2:]  # after one warm-up call each
    firsts = [timed[i][0] for i in range(0, len(timed), 2)]
    assert firsts == [0, 1, 0, 1, 0, 1]  # batch 0, 1, 2 of pass 0, then of pass 1
    assert all({timed[i][0], timed[i + 1][0]} == {0, 1} for i in range(0, len(timed), 2))
    monkeypatch.setattr(sys, "argv", ["graph_ab", "--data", ".", "--bundles", "a,b,c"])
    with pytest.raises(SystemExit):
        graph_ab.main()


class _FaultyServer:
    """A raw HTTP/1.1 server on a thread, to inject one fault: it resets (RST) a connection on
    its `reset_on`-th request instead of answering (0: never). Counts the connections it
    accepted."""

    def __init__(self, reset_on: int) -> None:
        self.reset_on, self.accepted = reset_on, 0
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/classify"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                served += 1
                if served == self.reset_on:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.parametrize(("reset_on", "label"), [(1, ":fresh"), (2, ":reused-after-idle-under-")])
def test_open_loop_says_whether_a_failed_connection_was_fresh_or_reused(bodies, reset_on, label):
    """A socket error names its connection: fresh, or reused after how long idle (how the
    overload resets were traced to the server's keep-alive timer)."""
    fake = _FaultyServer(reset_on)
    try:
        result = open_loop(fake.url, bodies, rate=40, seconds=1, timeout_s=5)
    finally:
        fake.close()
    kinds = result.extra["error_kinds"]
    assert result.errors > 0 and sum(kinds.values()) == result.errors
    assert all(k.startswith("exchange:ConnectionResetError" + label) for k in kinds), kinds
    if reset_on == 1:  # every connection reset on its first request
        assert result.statuses == {} and result.errors == fake.accepted
    else:  # each answered once, then reset when reused (the last ones may not be reused)
        assert result.statuses == {"200": fake.accepted}
        assert result.errors <= fake.accepted


def test_open_loop_preconnect_opens_its_connections_before_the_schedule(bodies):
    fake = _FaultyServer(reset_on=0)
    try:
        result = open_loop(fake.url, bodies, rate=40, seconds=1, timeout_s=5, preconnect=6)
    finally:
        fake.close()
    assert result.errors == 0 and result.requests == result.extra["sent"] > 0
    assert fake.accepted == 6  # every request went on one of them: none was opened later


BURN = """
import threading, time
def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
burned = threading.Event()
def side():
    burn(0.6)
    burned.set()
    time.sleep(30)
threading.Thread(target=side, daemon=True).start()
burn(0.3)
burned.wait()
print("done", flush=True)
time.sleep(30)
"""


def test_cpu_split_counts_a_process_main_thread_apart_from_its_other_threads():
    """bench.experiments.cpu_split's roles: a lone process's main thread is its event loop, the
    rest its model threads; the counts come from /proc, so what the threads burned is what is
    read."""
    import subprocess
    import sys

    from bench.experiments.cpu_split import batch_rows, threads_cpu

    proc = subprocess.Popen(
        [sys.executable, "-c", BURN], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "done"
        roles = threads_cpu(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert roles["supervisor"] == 0  # no workers: the leader is the server itself
    assert 0.25 <= roles["loops"] <= 0.55  # the main thread burned 0.3 s (plus start-up)
    assert 0.55 <= roles["other threads"] <= 0.7  # the other thread 0.6 s
    metrics = (
        'bertserve_batch_rows_sum{model="a"} 30.0\n'
        'bertserve_batch_rows_count{model="a"} 4.0\n'
        'bertserve_batch_rows_sum{model="b"} 10.0\n'
        'bertserve_batch_rows_count{model="b"} 1.0\n'
    )
    assert batch_rows(metrics) == (40.0, 5.0)


def test_cpu_split_refuses_a_ceiling_for_another_endpoint(monkeypatch, capsys):
    """The raw ceiling is /classify's bundle on its texts: asked beside /qa it would compare
    a QA server with a classifier's ceiling, so the arguments are refused before anything runs."""
    import sys

    from bench.experiments import cpu_split

    monkeypatch.setattr(sys, "argv", ["cpu_split", "--endpoint", "qa", "--ceiling"])
    with pytest.raises(SystemExit) as exc:
        cpu_split.main()
    assert exc.value.code == 2
    assert "only with classify" in capsys.readouterr().err


@pytest.mark.parametrize("spin", [False, True])
def test_idle_gap_times_the_call_and_not_the_gap_before_it(spin):
    """bench.experiments.idle_gap's cells differ only in the idle time before each call: that
    time (slept or spun) must stay out of the median, or every gapped cell would read gap + call."""
    import time

    from bench.ceiling import call_ms

    class Engine:
        calls = 0

        def run(self, feeds):
            Engine.calls += 1
            time.sleep(0.002)

    started = time.perf_counter()
    ms = call_ms(Engine(), [{}] * 5, gap_s=0.02, spin=spin)
    assert Engine.calls == 5
    assert time.perf_counter() - started >= 5 * 0.022  # the gaps were spent
    assert 2.0 <= ms < 10.0  # and the median is the call's 2 ms, not gap + call


def test_a_server_is_not_started_on_a_port_another_answers_on(tmp_path):
    """A server left over on the port would answer the readiness probe and be measured in place
    of the one started (whose bind fails): serve() refuses first, naming the port."""
    import socket

    from bench.servers import OURS, serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = pytest.raises(SystemExit, match=f"port {port} is taken")
        with refused, serve(OURS, tmp_path, tmp_path / "b", port, b"{}", tmp_path / "log"):
            pass
    assert not (tmp_path / "log").exists()  # nothing was started
