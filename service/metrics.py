"""Prometheus metrics, `bertserve_` prefix, one registry per app (tests run several apps).

With several serving processes (service.process.supervisor), prometheus_client's multiprocess mode
keeps each process's values in files under PROMETHEUS_MULTIPROC_DIR and any process's /metrics
reads them all: counters and histograms are summed over the processes; gauges say how: queue
depth, in-flight requests and open connections are summed over the live processes,
`bertserve_ready` is the minimum (1 only when every process is ready), model info the maximum.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values

from bertserve.service.http.errors import error_types

# In multiprocess mode every write of a value first asks the OS for the process id, to notice a
# fork: a system call each, a dozen a request. The id is cached here instead, and renewed in a
# forked child; the values of the service's metrics (all created after this import) use it.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))
if values.ValueClass is not values.MutexValue:  # PROMETHEUS_MULTIPROC_DIR was set at import
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: _pid[0])

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
STAGES = ("queue", "tokenize", "inference", "postprocess")


class GpuCollector:
    """GPU memory and utilisation from NVML (nvidia-ml-py, in the gpu extras), read at scrape
    time; nothing where there is no NVML or no GPU."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]

    @classmethod
    def create(cls) -> GpuCollector | None:
        try:
            collector = cls()
        except Exception:  # no nvidia-ml-py, no driver, no device: no GPU series
            return None
        return collector if collector.handles else None

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        used = GaugeMetricFamily(
            "bertserve_gpu_memory_used_bytes", "GPU memory in use", labels=["device"]
        )
        total = GaugeMetricFamily(
            "bertserve_gpu_memory_total_bytes", "GPU memory", labels=["device"]
        )
        busy = GaugeMetricFamily(
            "bertserve_gpu_utilization_ratio",
            "Share of time a kernel ran (NVML)",
            labels=["device"],
        )
        for i, handle in enumerate(self.handles):
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            used.add_metric([str(i)], memory.used)
            total.add_metric([str(i)], memory.total)
            busy.add_metric([str(i)], self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
        yield from (used, total, busy)


class Metrics:
    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._scraped: tuple[float, bytes] | None = None  # (when, text): scrape()
        self._rendering: asyncio.Future[bytes] | None = None  # the scrape being made
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "bertserve_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "bertserve_request_duration_seconds",
            "End-to-end request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "bertserve_stage_duration_seconds",
            "Latency by stage: queue, tokenize, inference, postprocess",
            ["endpoint", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "bertserve_batch_rows",
            "Sequences per model call",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_tokens = Histogram(
            "bertserve_batch_tokens",
            "Padded tokens per model call",
            ["model"],
            buckets=(16, 64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.padding = Histogram(
            "bertserve_batch_padding_ratio",
            "Share of a batch's tokens that are padding",
            ["model"],
            buckets=(0.0, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0),
            registry=r,
        )
        self.queue_depth = Gauge(
            "bertserve_queue_depth",
            "Sequences waiting or running (summed over the serving processes)",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.in_flight = Gauge(
            "bertserve_in_flight_requests",
            "Requests being handled (summed over the serving processes)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.open_connections = Gauge(
            "bertserve_open_connections",
            "Client connections open (summed over the serving processes; each process refuses "
            "past BERTSERVE_MAX_CONNECTIONS of its own)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.errors = Counter(
            "bertserve_errors",
            "Error responses by type (one a request)",
            ["error_type"],
            registry=r,
        )
        self.failed_batches = Counter(
            "bertserve_failed_batches",
            "Model calls that raised (each fails its rows' requests, counted in errors)",
            ["model"],
            registry=r,
        )
        self.lone_calls = Counter(
            "bertserve_lone_calls",
            "Model calls for a lone request (no other in flight in any worker), on the lone "
            "session's every core (BERTSERVE_LONE_THREADS)",
            ["model"],
            registry=r,
        )
        self.dropped = Counter(
            "bertserve_dropped_rows",
            "Sequences dropped before compute (cancelled; expired: past the deadline, or it "
            "would pass before the call ends; overdue: queued past max_queue_time_ms)",
            ["model", "reason"],
            registry=r,
        )
        self.unanswered_model_seconds = Counter(
            "bertserve_unanswered_model_seconds",
            "Model time spent on sequences whose answer nobody receives: their request's "
            "deadline passed during the call (expired) or its client left (cancelled); each "
            "such sequence's share of its call",
            ["model", "reason"],
            registry=r,
        )
        self.tenant_rows = Counter(
            "bertserve_tenant_rows",
            "Sequences handed to the model, by tenant (BERTSERVE_KEYS_FILE's tables; 'default': "
            "BERTSERVE_API_KEYS; 'anonymous': no key set): its served share (runtime.fairness)",
            ["model", "tenant"],
            registry=r,
        )
        self.model_info = Gauge(
            "bertserve_model_info",
            "Served models (value 1; what they are in the labels)",
            ["model", "tasks", "precision", "provider", "max_seq_len"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_loaded = Gauge(
            "bertserve_model_loaded",
            "1 while the model is loaded and serving (the loaded set: service.control)",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_memory = Gauge(
            "bertserve_model_memory_bytes",
            "what loading the model added to the resident memory of the serving processes, at "
            "least its model file's size (summed over them; at start, without its warm-up)",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.model_events = Counter(
            "bertserve_model_events",
            "Model management in each serving process: loaded, replaced, unloaded, failed",
            ["model", "event"],
            registry=r,
        )
        self.model_load_seconds = Histogram(
            "bertserve_model_load_seconds",
            "Loading a model while serving, warm-up included, in each serving process",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=r,
        )
        self.ready = Gauge(
            "bertserve_ready",
            "1 when every model of every serving process is loaded and warm",
            registry=r,
            multiprocess_mode="livemin",
        )
        gpu = GpuCollector.create()
        self.gpus: CollectorRegistry | None = None
        if gpu is not None:
            self.gpus = CollectorRegistry()
            self.gpus.register(gpu)
        for error_type in error_types():  # export zeros, not absent series, before the first error
            self.errors.labels(error_type)
        # Children of the per-request series, bound on first use: `labels()` takes a lock and
        # builds a key on every call, and these are touched several times per request.
        self._stages: dict[str, dict[str, Any]] = {}
        self._requests: dict[tuple[str, int], Any] = {}
        self._latency: dict[str, Any] = {}

    def exposition(self) -> bytes:
        """The text /metrics serves: this process's registry, or every process's, and the
        GPUs' memory and utilisation where NVML is at hand."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            whole = CollectorRegistry()
            multiprocess.MultiProcessCollector(whole)
            text = generate_latest(whole)
        else:
            text = generate_latest(self.registry)
        if self.gpus is not None:
            text += generate_latest(self.gpus)
        return text

    async def scrape(self, max_age: float) -> bytes:
        """`exposition()`, reused while it is younger than `max_age` seconds, and made on a
        thread, once for every scrape that waits for it: a collection costs about 15 ms with
        several workers' files to merge (the first 128 ms), which on the event loop held
        /health/live up to 351 ms under four clients scraping in a loop; eight such clients
        pushed /classify's p50 from 4 to 403 ms before scrapes were reused."""
        cached = self._scraped
        if cached is not None and time.monotonic() - cached[0] < max_age:
            return cached[1]
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(self._render())
        return await asyncio.shield(self._rendering)

    async def _render(self) -> bytes:
        try:
            started = time.monotonic()
            text = await asyncio.to_thread(self.exposition)
            self._scraped = (started, text)
            return text
        finally:
            self._rendering = None

    def stages(self, endpoint: str) -> dict[str, Any]:
        """The stage-latency histograms of `endpoint`, by stage."""
        found = self._stages.get(endpoint)
        if found is None:
            found = self._stages[endpoint] = {s: self.stage.labels(endpoint, s) for s in STAGES}
        return found

    def request_done(self, endpoint: str, status: int, elapsed: float | None) -> None:
        """Count a finished request; `elapsed` (seconds) feeds the latency histogram if given."""
        key = (endpoint, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(endpoint, str(status))
        counter.inc()
        if elapsed is not None:
            hist = self._latency.get(endpoint)
            if hist is None:
                hist = self._latency[endpoint] = self.latency.labels(endpoint)
            hist.observe(elapsed)
