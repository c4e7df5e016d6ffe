"""The engine process (service/process/engine_server.py, engine_client.py): the workers'
batches merged into one call with the same
answers, a runner that takes what queued behind a busy call, the handshake, and the topology as
a real process: parity with the default one, a killed engine replaced, SIGTERM."""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Client, Listener

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from bertserve.runtime.batching import Row, pad_rows
from bertserve.runtime.bundle import load_bundle_spec
from bertserve.runtime.engine import Engine, EngineOptions
from bertserve.service.http.errors import BackendError
from bertserve.service.process.engine_client import RemoteBackend
from bertserve.service.process.engine_server import (
    EngineServer,
    ModelRunner,
    _Job,
    merge_feeds,
    split_outputs,
)
from bertserve.service.process.wire import pack, unpack
from bertserve.service.settings import Settings
from tests.deploy.test_deploy import metric_names_used
from tests.helpers.server import free_port
from tests.service.process.test_process import start, unloadable_bundles, wait_ready, worker_pids


def rows(spec, lengths, seed):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(5, spec.architecture.vocab_size, n)
        ids[0], ids[-1] = spec.tokenizer.cls_id, spec.tokenizer.sep_id
        positions = np.array([1, n - 2]) if "mask_positions" in spec.inputs else None
        out.append(Row(ids.astype(np.int64), np.zeros(n, np.int64), mask_positions=positions))
    return out


@pytest.mark.parametrize("bundle", ["pretrained", "sentiment", "entities", "squad"])
def test_merged_batches_answer_as_the_batches_alone(bundle_dir, bundle):
    """Batches of different widths (and mask positions) padded into one call, then cut back:
    every output of every row is what that batch alone gets."""
    spec = load_bundle_spec(bundle_dir / bundle)
    engine = Engine(bundle_dir / bundle, spec, EngineOptions(threads=1))
    positions = 1 if "mask_positions" in spec.inputs else None
    parts = [
        pad_rows(rows(spec, [5, 9], 1), spec.tokenizer.pad_id, positions)[0],
        pad_rows(rows(spec, [17], 2), spec.tokenizer.pad_id, positions)[0],
        pad_rows(rows(spec, [3, 4, 6], 3), spec.tokenizer.pad_id, positions)[0],
    ]
    merged, spans = merge_feeds(parts, spec.tokenizer.pad_id)
    assert merged["input_ids"].shape == (6, 17)
    shares = split_outputs(engine.run(merged), spans, spec.output_axes)
    for part, share in zip(parts, shares, strict=True):
        alone = engine.run(part)
        assert share.keys() == alone.keys()
        for name, value in alone.items():
            assert share[name].shape == value.shape, name
            np.testing.assert_allclose(share[name], value, atol=1e-4, err_msg=name)


class Gated:
    """A real engine whose first call waits for a gate (a device busy with a long call), and
    which can be told to fail: fault injection, the arithmetic is ORT's."""

    def __init__(self, engine):
        self.engine, self.calls, self.fail = engine, [], False
        self.gate, self.entered = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, feeds, **options):
        self.calls.append(feeds["input_ids"].shape)
        self.entered.set()
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.engine.run(feeds, **options)


def test_the_runner_merges_what_queued_behind_a_busy_call_up_to_its_limits(bundle_dir):
    spec = load_bundle_spec(bundle_dir / "sentiment")
    gated = Gated(Engine(bundle_dir / "sentiment", spec, EngineOptions(threads=1)))
    runner = ModelRunner(gated, spec, max_rows=5, max_tokens=1000)
    pipes = [Pipe() for _ in range(4)]
    batches = [
        pad_rows(rows(spec, lengths, i), spec.tokenizer.pad_id, None)[0]
        for i, lengths in enumerate([[4], [6, 7], [8], [5, 5, 5]])
    ]
    runner.jobs.put(_Job(pipes[0][0], batches[0]))
    assert gated.entered.wait(10)  # the first batch is in the model
    for (ours, _), feeds in zip(pipes[1:], batches[1:], strict=True):
        runner.jobs.put(_Job(ours, feeds))
    gated.gate.set()
    answers = [unpack(theirs.recv_bytes()) for _, theirs in pipes]
    # 2 + 1 rows merged (8 wide); the 3 rows after them would pass max_rows: the next call.
    assert gated.calls == [(1, 4), (3, 8), (3, 5)]
    for feeds, (header, outputs) in zip(batches, answers, strict=True):
        assert header["kind"] == "ok"
        np.testing.assert_allclose(outputs["logits"], gated.engine.run(feeds)["logits"], atol=1e-4)


@pytest.fixture
def engine_server(bundle_dir, tmp_path):
    """An engine process's server on the tiny bundles, in this process: (server, address)."""
    settings = Settings(bundles=bundle_dir, warmup=False, engine_threads=1)
    server = EngineServer(settings, registry=CollectorRegistry())
    address = str(tmp_path / "engine.sock")
    listener = Listener(address, family="AF_UNIX")
    threading.Thread(target=server.serve, args=(listener,), daemon=True).start()
    yield server, address
    listener.close()


def test_a_failed_call_fails_its_batches_and_the_engine_serves_on(engine_server):
    server, address = engine_server
    runner = server.runners["sentiment"]
    gated = runner.engine = Gated(runner.engine)
    gated.gate.set()
    spec = runner.spec
    backend = RemoteBackend(address, spec)
    assert backend.provider == "CPUExecutionProvider"
    feeds = pad_rows(rows(spec, [6], 0), spec.tokenizer.pad_id, None)[0]
    gated.fail = True
    with pytest.raises(BackendError, match="failed the call: RuntimeError"):
        backend.run(feeds)
    gated.fail = False
    assert backend.run(feeds)["logits"].shape == (1, len(spec.labels))

    # A worker whose bundle is not the engine's is told so, by name.
    other = spec.model_copy(update={"model_sha256": "0" * 64})
    with pytest.raises(BackendError, match="loaded other graph files"):
        RemoteBackend(address, other)
    with pytest.raises(BackendError, match="has no model 'nope'"):
        RemoteBackend(address, spec.model_copy(update={"name": "nope"}))
    backend.close()


GREETING = object()  # stands for a right greeting: the hash is the fixture's


def test_a_call_that_never_ends_is_taken_for_a_hung_device(engine_server):
    """A call past ENGINE_CALL_TIMEOUT_S makes the watchdog act (in the engine process: log,
    exit, be replaced, and the workers resend their batches once, as the SIGKILL test shows);
    calls that end are not watched. The hang is injected: a gate that is not opened."""
    server, _ = engine_server
    runner = server.runners["sentiment"]
    spec = runner.spec
    feeds = pad_rows(rows(spec, [6], 0), spec.tokenizer.pad_id, None)[0]
    ours, theirs = Pipe()
    runner.jobs.put(_Job(ours, feeds))  # a normal call: it ends, nothing is watched after it
    unpack(theirs.recv_bytes())
    assert runner.call_started is None

    gated = runner.engine = Gated(runner.engine)
    hung: list[tuple[str, float]] = []
    watchdog = threading.Thread(
        target=server.watch, args=(0.3, lambda *a: hung.append(a)), daemon=True
    )
    watchdog.start()
    time.sleep(0.5)
    assert hung == []  # idle: no call is running
    runner.jobs.put(_Job(ours, feeds))
    assert gated.entered.wait(10)
    watchdog.join(10)
    assert [name for name, _ in hung] == ["sentiment"] and hung[0][1] > 0.3
    gated.gate.set()  # let the runner thread go
    assert unpack(theirs.recv_bytes())[0]["kind"] == "ok"


LOADED: list[str] = []


def record_load(what: str) -> tuple[str, str]:
    LOADED.append(what)
    return ("sentiment", "0" * 64)


class Payload:
    """A pickle that, if loaded (in this process: the test's engine runs here), says so."""

    def __reduce__(self):
        return (record_load, ("the engine unpickled a message",))


@pytest.mark.parametrize(
    "messages",
    [
        [pickle.dumps(Payload())],  # the old protocol's greeting was a pickle
        [GREETING, pickle.dumps(Payload())],
        [pack("run", {"input_ids": np.zeros((1, 3), np.int64)})],  # a batch before the greeting
        [b"\x00\x00\x00\x05{}"],  # a header cut short
    ],
    ids=["pickled-hello", "pickled-batch", "batch-first", "truncated"],
)
def test_a_message_out_of_format_is_hung_up_on_not_loaded(engine_server, messages):
    """No pickle is loaded (design.md): a connection that sends one, or anything else out of
    service/process/wire.py's format, is closed, and the engine serves the next worker."""
    server, address = engine_server
    spec = server.runners["sentiment"].spec
    greeting = pack("hello", model="sentiment", sha256=spec.model_sha256)
    messages = [greeting if m is GREETING else m for m in messages]
    conn = Client(address, family="AF_UNIX")
    for message in messages:
        conn.send_bytes(message)
    with pytest.raises(EOFError):
        while True:  # the greeting's answer, then the hang-up
            header, _ = unpack(conn.recv_bytes())
            assert header["kind"] == "ok"
    conn.close()
    backend = RemoteBackend(address, spec)
    feeds = pad_rows(rows(spec, [6], 0), spec.tokenizer.pad_id, None)[0]
    assert backend.run(feeds)["logits"].shape == (1, len(spec.labels))
    backend.close()
    assert LOADED == []


REQUESTS = [
    ("/classify", {"inputs": ["a fine film", "dull"]}),
    ("/ner", {"inputs": "Ada Lovelace worked in London with Charles Babbage."}),
    ("/qa", {"inputs": {"question": "Who wrote it?", "context": "It was written by Ada."}}),
    ("/fill-mask", {"inputs": "Paris is the [MASK] of France."}),
    ("/nsp", {"inputs": {"text": "It rained.", "text_pair": "The streets were wet."}}),
]


def close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return abs(a - b) < 1e-4
    return a == b


@pytest.mark.slow
def test_the_engine_process_topology_answers_as_the_default_and_survives_its_engine(bundle_dir):
    answers = {}
    for topology in ("workers", "engine"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {"engine_process": "true"} if topology == "engine" else {}
        process = start(bundle_dir, port, workers=2, **env)
        try:
            wait_ready(url, process)
            with httpx.Client(base_url=url, timeout=30) as c:
                replies = [c.post(path, json=body) for path, body in REQUESTS]
                assert [r.status_code for r in replies] == [200] * len(REQUESTS), replies[0].text
                answers[topology] = [r.json() for r in replies]
                if topology == "engine":
                    survives_its_engine(c, process)
            process.send_signal(signal.SIGTERM)  # both arms stop as deployed: drained, exit 0
            assert process.wait(timeout=60) == 0
            logs = process.stdout.read()
            if topology == "engine":
                assert "the engine process died with -9: replacing it" in logs
                assert "engine process exited with 0" in logs
        finally:
            process.kill()
    for (path, _), a, b in zip(REQUESTS, answers["workers"], answers["engine"], strict=True):
        assert close(a, b), (path, a, b)


def survives_its_engine(c, process):
    """The engine topology's scrape has the engine's metrics; its engine dies and is
    replaced, and a request sent meanwhile is answered."""
    metrics = c.get("/metrics").text
    assert "bertserve_engine_batch_rows_count" in metrics
    # ... and every engine metric the Grafana dashboard plots
    exported = set(re.findall(r"^(bertserve_engine_[a-z_]+)", metrics, re.M))
    used = {n for n in metric_names_used() if n.startswith("bertserve_engine_")}
    assert used and used <= exported, sorted(used - exported)
    assert 'bertserve_requests_total{endpoint="/classify",status="200"} 1.0' in metrics

    # The engine dies: readiness says so, the supervisor starts another, and a
    # request sent meanwhile is answered (its batch is sent again to the new one).
    # the engine is started first: the lowest pid of the supervisor's processes
    engine, *workers = worker_pids(process.pid)
    assert len(workers) == 2
    os.kill(engine, signal.SIGKILL)
    during = c.post("/classify", json={"inputs": "sent while it restarts"})
    assert during.status_code == 200, during.text
    deadline, statuses = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        statuses.append(c.get("/health/ready").status_code)
        if statuses[-1] == 200:
            break
        time.sleep(0.05)
    assert statuses[-1] == 200
    now = worker_pids(process.pid)
    assert len(now) == 3 and engine not in now and set(workers) < set(now)


@pytest.mark.slow
def test_an_engine_process_that_cannot_start_stops_the_supervisor(bundle_dir, tmp_path):
    """No workers are started for an engine that never got ready: exit 1, saying why."""
    bundles = unloadable_bundles(bundle_dir, tmp_path)
    process = start(bundles, free_port(), workers=2, engine_process="true")
    try:
        assert process.wait(timeout=60) == 1
        logs = process.stdout.read()
        assert "ONNX Runtime cannot load it" in logs
        assert "the engine process exited with 1 before it was ready: stopping" in logs
        assert "worker 0 started" not in logs
    finally:
        process.kill()


def test_rows_without_mask_slots_send_none_and_get_the_same_answers(bundle_dir):
    """/nsp rows carry no mask positions: alone they send a mask_positions input of width 0
    (the MLM head runs on nothing), beside fill-mask rows they pad to those rows' width; their
    NSP answer is the same either way, merged into an engine call or not."""
    spec = load_bundle_spec(bundle_dir / "pretrained")
    engine = Engine(bundle_dir / "pretrained", spec, EngineOptions(threads=1))
    pairs = [Row(r.input_ids, r.token_type_ids) for r in rows(spec, [7, 12], 5)]
    masked = rows(spec, [9], 6)  # positions [1, 7]
    pad = spec.tokenizer.pad_id
    one, none, mixed = (
        pad_rows(r, pad, w)[0] for r, w in ((pairs, 1), (pairs, 0), (pairs + masked, 0))
    )
    assert one["mask_positions"].shape == (2, 1) and none["mask_positions"].shape == (2, 0)
    assert mixed["mask_positions"].tolist() == [[0, 0], [0, 0], [1, 7]]
    reference = engine.run(one)
    alone = engine.run(none)
    assert alone["mlm_logits"].shape == (2, 0, spec.architecture.vocab_size)
    np.testing.assert_allclose(alone["nsp_logits"], reference["nsp_logits"], atol=1e-5)
    np.testing.assert_allclose(
        engine.run(mixed)["nsp_logits"][:2], reference["nsp_logits"], atol=1e-5
    )
    merged, spans = merge_feeds([none, pad_rows(masked, pad, 0)[0]], pad)
    shares = split_outputs(engine.run(merged), spans, spec.output_axes)
    assert shares[0]["mlm_logits"].shape[1] == 0 and shares[1]["mlm_logits"].shape[1] == 2
    np.testing.assert_allclose(shares[0]["nsp_logits"], reference["nsp_logits"], atol=1e-5)


class _Refuses:
    """An engine (an execution provider) that refuses an empty mask_positions input."""

    def __init__(self, engine):
        self.engine, self.provider = engine, engine.provider

    def run(self, feeds):
        if feeds["mask_positions"].shape[1] == 0:
            raise BackendError("empty tensor")
        return self.engine.run(feeds)


class _Differs(_Refuses):
    """An engine whose other outputs change without mask slots."""

    def run(self, feeds):
        out = self.engine.run(feeds)
        if feeds["mask_positions"].shape[1] == 0:
            out = out | {"nsp_logits": out["nsp_logits"] + 1}
        return out


@pytest.mark.parametrize("fault", [None, _Refuses, _Differs])
def test_the_warm_up_probe_allows_empty_slots_only_where_they_run_alike(
    bundle_dir, tmp_path, fault, caplog
):
    import shutil

    from bertserve.service.metrics import Metrics
    from bertserve.service.state import ServiceState

    caplog.set_level(logging.INFO, logger="bertserve.warmup")  # whatever the root's level
    shutil.copytree(bundle_dir / "pretrained", tmp_path / "pretrained")
    state = ServiceState(Settings(bundles=tmp_path, intra_op_threads=1), Metrics())
    state.load()
    model = state.models["pretrained"]
    assert model.batcher.positions == 1  # one slot a row until the probe says otherwise
    if fault is not None:
        model.engine = fault(model.engine)
    state.warm_up()
    assert model.batcher.positions == (0 if fault is None else 1)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == (0 if fault is None else 1), warned
    if fault is _Refuses:
        assert "no empty mask_positions" in warned[0]
    if fault is _Differs:
        assert "answers differ without mask slots" in warned[0]
    skipping = [r.getMessage() for r in caplog.records if "skip the MLM head" in r.getMessage()]
    assert len(skipping) == (1 if fault is None else 0)  # the operator can see which it is


def test_token_states_cross_the_engine_process_only_for_batches_that_want_them(tmp_path):
    """An embedding graph's token states (late chunking) are computed on demand: a worker's
    batch that wants them gets them through the engine process, merged with another worker's
    batch that does not, and a batch that does not want them gets the pooled vectors alone."""
    from bertserve.export.bundle import build_bundle
    from tests.helpers.families import family_checkpoint

    checkpoint = family_checkpoint(tmp_path / "ckpt", "distilbert", "embed")
    root = tmp_path / "bundles"
    build_bundle(checkpoint, ["embed"], root / "tiny-embed")
    settings = Settings(bundles=root, warmup=False, engine_threads=1)
    server = EngineServer(settings, registry=CollectorRegistry())
    address = str(tmp_path / "engine.sock")
    listener = Listener(address, family="AF_UNIX")
    threading.Thread(target=server.serve, args=(listener,), daemon=True).start()
    try:
        runner = server.runners["tiny-embed"]
        spec = runner.spec
        assert spec.output_axes["token_embeddings"] == "token"
        feeds = pad_rows(rows(spec, [6, 9], 0), spec.tokenizer.pad_id, None)[0]
        backend = RemoteBackend(address, spec)
        plain = backend.run(feeds)
        assert list(plain) == ["embeddings"]
        wanted = backend.run(feeds, extra=("token_embeddings",))
        states = wanted["token_embeddings"]
        assert states.shape[:2] == feeds["input_ids"].shape
        mask = feeds["attention_mask"].astype(bool)
        for i in range(2):  # the pooled vector is the mean of the real tokens' states
            np.testing.assert_allclose(
                states[i][mask[i]].mean(0), wanted["embeddings"][i], atol=1e-5
            )
        # Two workers' batches in one call, one wanting the states: each gets its own rows.
        gated = runner.engine = Gated(runner.engine)
        other = pad_rows(rows(spec, [4], 1), spec.tokenizer.pad_id, None)[0]
        ours, theirs = Pipe(), Pipe()
        runner.jobs.put(_Job(ours[0], other))
        assert gated.entered.wait(10)
        runner.jobs.put(_Job(theirs[0], other, ("token_embeddings",)))
        runner.jobs.put(_Job(ours[0], feeds, ("token_embeddings",)))
        gated.gate.set()
        first, second, third = (
            unpack(ours[1].recv_bytes()),
            unpack(theirs[1].recv_bytes()),
            unpack(ours[1].recv_bytes()),
        )
        assert list(first[1]) == ["embeddings"]
        assert second[1]["token_embeddings"].shape[1] == other["input_ids"].shape[1]
        np.testing.assert_allclose(third[1]["token_embeddings"], states, atol=1e-5)
        backend.close()
    finally:
        listener.close()
