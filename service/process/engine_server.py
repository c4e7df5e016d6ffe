"""One engine process for every serving worker (`BERTSERVE_ENGINE_PROCESS`): the GPU topology
(docs/architecture.md).

The front-end workers keep HTTP, JSON, tokenising and batching; instead of their own ONNX
Runtime sessions they hold a `RemoteBackend` a model, which sends each padded batch to this
process over a Unix socket and waits for the outputs. Here one `ModelRunner` a model takes what
every worker has sent meanwhile, pads it into one call (`merge_feeds`), runs it on the one
session (one CUDA context holds the weights; the device sees the batches of all workers
together) and hands each worker its share (`split_outputs`). This is the split of vLLM's API
servers from its engine core and of TEI's router from its backend, with the batcher's `Backend`
protocol as the seam: a batcher cannot tell a remote engine from a local one.

The socket lives in a directory only this user can open (`tempfile.mkdtemp`: mode 0700). The
messages are service/process/wire.py's: a JSON header and the arrays' raw bytes, never a pickle (a
batch of 32 x 128 int64 ids is 32 kB).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from bertserve.runtime.bundle import BundleSpec, bundle_dirs, check_model_file, load_bundle_spec
from bertserve.runtime.engine import Engine, warmup_feeds
from bertserve.service.logs import configure_logging
from bertserve.service.process.wire import WireError, pack, unpack

log = logging.getLogger("bertserve.engine_server")


@dataclass(frozen=True)
class Span:
    """One worker's batch inside a merged call: its rows, and the widths it was padded to."""

    start: int
    rows: int
    width: int
    mask_width: int


def merge_feeds(
    parts: list[dict[str, np.ndarray]], pad_id: int
) -> tuple[dict[str, np.ndarray], list[Span]]:
    """Stack several padded batches into one call: each input right-padded to the widest
    (input_ids with `pad_id`, the attention mask with 0, so the extra positions change no row's
    answer), the rows one after another."""
    spans, start = [], 0
    for part in parts:
        rows, width = part["input_ids"].shape
        mask = part.get("mask_positions")
        spans.append(Span(start, rows, width, 0 if mask is None else mask.shape[1]))
        start += rows
    if len(parts) == 1:
        return parts[0], spans
    merged = {}
    for name in parts[0]:
        width = max(p[name].shape[1] for p in parts)
        out = np.full((start, width), pad_id if name == "input_ids" else 0, dtype=np.int64)
        for span, part in zip(spans, parts, strict=True):
            value = part[name]
            out[span.start : span.start + span.rows, : value.shape[1]] = value
        merged[name] = out
    return merged, spans


def split_outputs(
    outputs: dict[str, np.ndarray], spans: list[Span], axes: Mapping[str, str]
) -> list[dict[str, np.ndarray]]:
    """Each merged batch's outputs, cut back to the widths it was sent with (the output's
    declared axes: "token" outputs to its width, "mask" outputs to its mask positions)."""
    if len(spans) == 1:
        return [outputs]
    shares = []
    for span in spans:
        rows = slice(span.start, span.start + span.rows)
        share = {}
        for name, value in outputs.items():
            kind = axes.get(name, "sequence")
            if kind == "token":
                share[name] = value[rows, : span.width]
            elif kind == "mask":
                share[name] = value[rows, : span.mask_width]
            else:
                share[name] = value[rows]
        shares.append(share)
    return shares


@dataclass
class _Job:
    conn: Connection
    feeds: dict[str, np.ndarray]
    extra: tuple[str, ...] = ()  # outputs computed on demand that its rows want

    @property
    def rows(self) -> int:
        return int(self.feeds["input_ids"].shape[0])


class ModelRunner:
    """One model's session and the thread that merges the workers' batches into its calls."""

    def __init__(
        self, engine: Any, spec: BundleSpec, max_rows: int, max_tokens: int, observe: Any = None
    ) -> None:
        self.engine, self.spec = engine, spec
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.observe = observe  # (parts, rows) of each call, for the metrics
        self._held: _Job | None = None  # taken from the queue but past the last call's limits
        self.call_started: float | None = None  # monotonic start of the call running, if any
        # Answers are packed and written by a second thread, while the next call runs (a
        # profile found the model's thread spending a good part of its time writing them).
        self._replies: queue.SimpleQueue[tuple[Connection, bytes]] = queue.SimpleQueue()
        for target, name in ((self._loop, "engine"), (self._reply, "engine-replies")):
            threading.Thread(target=target, name=f"{name}-{spec.name}", daemon=True).start()

    def _reply(self) -> None:
        while True:
            conn, answer = self._replies.get()
            with contextlib.suppress(OSError):  # that worker is gone; its batch with it
                conn.send_bytes(answer)

    def _take(self) -> list[_Job]:
        """The oldest job, and every job queued behind it that fits in the same call."""
        first = self._held or self.jobs.get()
        self._held = None
        jobs, rows = [first], first.rows
        widest = first.feeds["input_ids"].shape[1]
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return jobs
            widest = max(widest, job.feeds["input_ids"].shape[1])
            if rows + job.rows > self.max_rows or (rows + job.rows) * widest > self.max_tokens:
                self._held = job
                return jobs
            jobs.append(job)
            rows += job.rows

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            merged, spans = merge_feeds([j.feeds for j in jobs], self.spec.tokenizer.pad_id)
            self.call_started = time.monotonic()
            try:
                extra = tuple(sorted({name for job in jobs for name in job.extra}))
                outputs = self.engine.run(merged, extra=extra) if extra else self.engine.run(merged)
            except Exception as exc:  # the call fails its batches, not the process
                log.exception(
                    "model %s failed a merged call of %d batches", self.spec.name, len(jobs)
                )
                reply = [pack("error", message=type(exc).__name__)] * len(jobs)
            else:
                shares = split_outputs(outputs, spans, self.spec.output_axes)
                reply = [pack("ok", share) for share in shares]
            finally:
                self.call_started = None
            if self.observe is not None:
                self.observe(len(jobs), int(merged["input_ids"].shape[0]))
            for job, answer in zip(jobs, reply, strict=True):
                self._replies.put((job.conn, answer))


class EngineServer:
    """The engine process: every bundle's session, and a thread a worker connection."""

    def __init__(self, settings: Any, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Histogram

        registry = REGISTRY if registry is None else registry

        self.runners: dict[str, ModelRunner] = {}
        self.connections = 0
        self._lock = threading.Lock()
        options = settings.engine_options(device=True)
        # A merged call may hold every worker's largest batch.
        max_rows = settings.max_batch_rows * settings.worker_count
        max_tokens = settings.max_batch_tokens * settings.worker_count
        parts = Histogram(
            "bertserve_engine_merged_batches",
            "Workers' batches merged into one call of the engine process",
            ["model"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=registry,
        )
        rows = Histogram(
            "bertserve_engine_batch_rows",
            "Sequences in one call of the engine process",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        for directory in bundle_dirs(settings.bundles):
            spec = load_bundle_spec(directory)
            check_model_file(directory, spec)
            engine = Engine(directory, spec, options)
            if settings.warmup:  # before the supervisor hears "ready", also after a restart
                heads = tuple(spec.heads)  # head graphs run only when asked: warm them too
                for feeds in warmup_feeds(spec, settings.max_batch_rows, settings.max_batch_tokens):
                    engine.run(feeds)
                    if heads:
                        engine.run(feeds, extra=heads)
            engine.warmed()

            def observe(n: int, r: int, name: str = spec.name) -> None:
                parts.labels(name).observe(n)
                rows.labels(name).observe(r)

            self.runners[spec.name] = ModelRunner(engine, spec, max_rows, max_tokens, observe)
            log.info(
                "engine process loaded %s on %s (%d threads)",
                spec.name,
                engine.provider,
                options.threads,
            )

    def watch(self, timeout_s: float, on_hang: Callable[[str, float], None]) -> None:
        """Return once a model's call has run longer than `timeout_s`, after calling `on_hang`
        with its name and age. A device that hangs (a CUDA kernel that never ends) would
        otherwise hold every worker's batches forever, with the process alive and ready."""
        while True:
            time.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for name, runner in self.runners.items():
                started = runner.call_started
                if started is not None and now - started > timeout_s:
                    on_hang(name, now - started)
                    return

    def serve(self, listener: Listener) -> None:
        while True:
            conn = listener.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._lock:
            self.connections += 1
        try:
            runner = self._hello(conn)
            if runner is None:
                return
            while True:
                runner.jobs.put(_Job(conn, *_batch(conn.recv_bytes())))
        except (EOFError, OSError):  # the worker closed its end (it exited, or reconnects)
            pass
        except WireError as exc:  # not a worker of this version: hang up on it
            log.warning("the engine process closed a connection that sent %s", exc)
        finally:
            conn.close()
            with self._lock:
                self.connections -= 1

    def _hello(self, conn: Connection) -> ModelRunner | None:
        """A worker names the model and the sha256 of the graph it loaded from its bundle; the
        engine answers with its provider, or says why it cannot serve that model."""
        hello, _ = unpack(conn.recv_bytes())
        name, sha256 = hello.get("model"), hello.get("sha256")
        if hello["kind"] != "hello" or not isinstance(name, str):
            raise WireError(f"a {hello['kind']!r} message where a 'hello' naming a model was due")
        runner = self.runners.get(name)
        if runner is None:
            conn.send_bytes(pack("error", message=f"the engine process has no model {name!r}"))
            return None
        if runner.spec.graphs_sha256 != sha256:
            message = f"{name}: the engine process loaded other graph files ({runner.spec.files})"
            conn.send_bytes(pack("error", message=message))
            return None
        engine = runner.engine
        conn.send_bytes(pack("ok", provider=engine.provider, requested=engine.requested))
        return runner


def _batch(message: bytes) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """A worker's padded batch: a "run" message whose arrays are int64 matrices of the same
    rows, `input_ids` among them (what merge_feeds takes), and the outputs computed on demand
    it wants (`extra`: names of strings)."""
    header, feeds = unpack(message)
    extra = header.get("extra") or []
    if not isinstance(extra, list) or not all(isinstance(n, str) for n in extra):
        raise WireError(f"extra {extra!r} is not a list of output names")
    if header["kind"] != "run" or "input_ids" not in feeds:
        raise WireError(f"a {header['kind']!r} message without input_ids where a batch was due")
    rows = feeds["input_ids"].shape[0]
    for name, value in feeds.items():
        if value.dtype != np.int64 or value.ndim != 2 or value.shape[0] != rows:
            raise WireError(f"{name}: {value.dtype} {value.shape} in a batch of {rows} rows")
    return feeds, tuple(extra)


def engine_main(values: dict[str, Any], address: str, ready: Any) -> None:
    """The engine process: load every bundle, listen on `address`, set `ready`, and serve the
    workers until SIGTERM, then until the last of them has closed its connection."""
    from bertserve.service.settings import Settings  # in the spawned process: nothing imported yet

    settings = Settings(**values)
    configure_logging(settings.log_level)
    stopping = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which drains
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    server = EngineServer(settings)
    listener = Listener(address, family="AF_UNIX", backlog=256)
    threading.Thread(target=server.serve, args=(listener,), daemon=True).start()
    if settings.engine_call_timeout_s > 0:

        def exit_hung(name: str, seconds: float) -> None:
            log.error(
                "model %s: a call has run %.1f s, past BERTSERVE_ENGINE_CALL_TIMEOUT_S=%g: the "
                "device is taken for hung; the engine process exits, to be replaced",
                name,
                seconds,
                settings.engine_call_timeout_s,
            )
            logging.shutdown()  # flush the line: no thread will run after this exit
            os._exit(3)  # the stuck call cannot be interrupted, so no clean exit will come

        timeout = settings.engine_call_timeout_s
        threading.Thread(target=server.watch, args=(timeout, exit_hung), daemon=True).start()
    ready.set()
    log.info("engine process ready on %s", address)
    stopping.wait()
    # The supervisor stops the engine after the workers have drained; a worker still connected
    # gets until its drain would have ended.
    deadline = time.monotonic() + settings.drain_timeout_s
    while server.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    listener.close()
    log.info("engine process stopped")
