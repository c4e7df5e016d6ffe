"""What the app holds while it runs: the loaded models, readiness and draining."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.batching import Batcher, without_slots
from runtime.bundle import (
    BUNDLE_FILE,
    BundleError,
    BundleSpec,
    bundle_dirs,
    check_model_file,
    load_bundle_spec,
)
from runtime.engine import Engine, warmup_feeds
from runtime.tasks import CAPABILITIES, TASKS
from runtime.tasks.common import TaskContext
from service.auth import PUBLIC_PATHS
from service.engine_client import RemoteBackend
from service.errors import NotFound, NotReady, Overloaded, ServiceError
from service.memory import Trimmer
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)
RETRY_HEADERS = {"Retry-After": "1"}
DRAINING_HEADERS = {"Retry-After": "1", "Connection": "close"}


def check_serves(directory: Path, spec: BundleSpec) -> None:
    """Every task the bundle declares is one an endpoint serves, with the outputs it reads."""
    for task in spec.tasks:
        reads = CAPABILITIES.get(task)
        if reads is None:
            raise BundleError(
                f"{directory / BUNDLE_FILE}: task {task!r} is served by no endpoint; "
                f"known: {sorted(CAPABILITIES)}"
            )
        missing = sorted(reads - set(spec.outputs))
        if missing:
            raise BundleError(f"{directory / BUNDLE_FILE}: {task} needs the outputs {missing}")


@dataclass
class Model:
    name: str
    spec: BundleSpec
    ctx: TaskContext
    engine: Engine | RemoteBackend
    batcher: Batcher


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    models: dict[str, Model] = field(default_factory=dict)
    warmed: bool = False
    failed: str | None = None  # why start-up failed after the server bound: liveness says so
    draining: bool = False
    in_flight: int = 0
    defaults: dict[str, Model] = field(default_factory=dict)  # task -> the model without ?model=
    worker: int | None = None  # this process's slot among the supervisor's workers
    peers_ready: Callable[[], bool] = lambda: True  # every worker ready (workers > 1)
    retiring: bool = False  # replaced for its memory: finishing its connections (server.py)
    trimmer: Trimmer = field(default_factory=Trimmer)
    _warming: asyncio.Task[None] | None = None

    @property
    def dead(self) -> str | None:
        """Why this process can no longer serve and should be restarted (liveness fails): its
        warm-up raised, or a model failed call after call (a CUDA error leaves the context
        unusable; a restart is the cure)."""
        if self.failed is not None:
            return self.failed
        limit = self.settings.failed_batches_fatal
        for model in self.models.values():
            if model.batcher.consecutive_failures >= limit:
                return (
                    f"model {model.name} failed {model.batcher.consecutive_failures} calls in a row"
                )
        return None

    @property
    def ready_here(self) -> bool:
        """This process: loaded, warm, not draining, not dead, every batching worker alive."""
        return (
            self.warmed
            and not self.draining
            and bool(self.models)
            and self.dead is None
            and all(m.batcher.alive for m in self.models.values())
        )

    @property
    def ready(self) -> bool:
        """Every serving process of this port is ready (one process: this one)."""
        return self.ready_here and self.peers_ready()

    def __post_init__(self) -> None:
        limits = self.settings
        # The refusals that depend only on the settings: one instance each, encoded once.
        self._draining = NotReady("the service is shutting down; retry", DRAINING_HEADERS)
        self._crowded = NotReady(
            f"{limits.max_in_flight} requests in flight (the limit); retry shortly", RETRY_HEADERS
        )
        self._connections = NotReady(
            f"this process has {limits.max_connections} connections open (the limit); "
            "retry shortly",
            DRAINING_HEADERS,
        )
        self._overloaded: dict[str, Overloaded] = {}  # by reason: a few fixed texts a model

    def refusal(self, method: str, path: str, connections: int = 0) -> ServiceError | None:
        """Why this request is answered at once, before its body is parsed (None: it is admitted).
        One decision for both places that enforce it: the HTTP protocol (service.protocol: no
        ASGI task at all) and the outermost middleware. The probes and /metrics always pass;
        the API key is checked after this, so an overloaded or draining service refuses
        unauthenticated requests the same way."""
        if path in PUBLIC_PATHS:
            return None
        if self.draining:  # the client should go elsewhere: this connection ends with it
            return self._draining
        if connections > self.settings.max_connections:
            return self._connections
        if self.in_flight >= self.settings.max_in_flight:
            return self._crowded
        task = TASKS.get(path)
        busy = self.saturated(task.capability) if task is not None and method == "POST" else None
        if busy is None:
            return None
        if busy not in self._overloaded:
            self._overloaded[busy] = Overloaded(busy, RETRY_HEADERS)
        return self._overloaded[busy]

    def saturated(self, task: str) -> str | None:
        """Why a request for `task` would be refused for load, when every model serving it has
        a full queue: checked before the body is read, so a 429 costs next to nothing."""
        serving = [m for m in self.models.values() if task in m.spec.tasks]
        reasons = []
        for model in serving:
            reason = model.batcher.refusal()
            if reason is None:
                return None
            reasons.append(reason)
        if not reasons:
            return None
        return f"every model for {task} is full ({'; '.join(reasons)}); retry shortly"

    def serving(self) -> dict[str, list[str]]:
        """Task -> the names of the models serving it, the default first."""
        out: dict[str, list[str]] = {}
        for model in sorted(self.models.values(), key=lambda m: not m.spec.default):
            for task in model.spec.tasks:
                out.setdefault(task, []).append(model.name)
        return out

    def model_for(self, task: str, name: str | None) -> Model:
        if self.draining:
            raise NotReady("the service is shutting down")
        if not self.warmed:
            raise NotReady("the service is starting: models are not loaded and warm yet")
        if name is not None:
            model = self.models.get(name)
            if model is None or task not in model.spec.tasks:
                serving = [m for m in self.models.values() if task in m.spec.tasks]
                raise NotFound(
                    f"no model {name!r} serves {task}; models for {task}: "
                    f"{[m.name for m in serving]}"
                )
            return model
        default = self.defaults.get(task)
        if default is None:
            raise NotFound(f"no loaded bundle serves {task} (see GET /models)")
        return default

    def load(self) -> None:
        """Load every bundle under settings.bundles; a bad one is a BundleError naming it."""
        root = self.settings.bundles
        dirs = bundle_dirs(root)
        if not dirs:
            raise BundleError(f"{root}: no bundles (no */{BUNDLE_FILE})")
        for directory in dirs:
            spec = load_bundle_spec(directory)
            check_model_file(directory, spec)
            check_serves(directory, spec)
            if spec.name in self.models:
                raise BundleError(
                    f"{directory / BUNDLE_FILE}: name {spec.name!r} is taken by another bundle"
                )
            engine: Engine | RemoteBackend
            if self.settings.engine_address:  # the engine process runs it (service.engine_server)
                engine = RemoteBackend(self.settings.engine_address, spec)
            else:
                engine = Engine(directory, spec, self.settings.engine_options())
            max_rows = min(self.settings.max_request_rows, self.settings.max_queue_rows)
            ctx = TaskContext.load(directory, spec, self.settings.max_text_chars, max_rows)
            batcher = Batcher(
                spec.name,
                engine,
                self.settings,
                self.metrics,
                spec.output_axes,
                spec.tokenizer.pad_id,
                1 if "mask_positions" in spec.inputs else None,  # until probe_slots says 0
            )
            self.models[spec.name] = Model(spec.name, spec, ctx, engine, batcher)
            self.metrics.model_info.labels(
                spec.name,
                ",".join(spec.tasks),
                spec.precision,
                engine.provider,
                str(spec.max_seq_len),
            ).set(1)
            log.info(
                "loaded %s (%s, %s) on %s",
                spec.name,
                ",".join(spec.tasks),
                spec.precision,
                engine.provider,
            )
        self.defaults = {t: self.models[names[0]] for t, names in self.serving().items()}
        for task, names in self.serving().items():
            marked = [n for n in names if self.models[n].spec.default]
            if len(marked) > 1:
                raise BundleError(f"{root}: bundles {marked} all say default for {task}; keep one")

    def warm_up(self) -> None:
        """Run representative shapes through every model before saying ready: ORT allocates
        and picks kernels on first use of a shape."""
        for model in self.models.values():
            started = time.monotonic()
            shapes = warmup_feeds(
                model.spec, self.settings.max_batch_rows, self.settings.max_batch_tokens
            )
            first = model.engine.run(shapes[0])
            for feeds in shapes[1:]:
                model.engine.run(feeds)
            if model.batcher.positions is not None:
                self.probe_slots(model, shapes[0], first)
            log.info(
                "warmed %s in %.2f s%s",
                model.name,
                time.monotonic() - started,
                "; rows without mask slots (/nsp) skip the MLM head"
                if model.batcher.positions == 0
                else "",
            )

    def probe_slots(
        self, model: Model, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]
    ) -> None:
        """Let rows without fill-mask slots (/nsp) skip the MLM head, when the graph runs
        `feeds` (a warm-up shape, `outputs` its answers) with a mask_positions input of width 0
        and answers its other outputs alike. A 2x128 graph's call took 20% less so
        (docs/performance.md). An execution provider that refuses empty tensors
        keeps one ignored slot a row: a warning, not a failure."""
        try:
            pairs = without_slots(model.engine.run, feeds, outputs, model.spec.output_axes)
        except Exception as exc:  # any refusal keeps the safe width
            log.warning("%s: no empty mask_positions (%r); one slot a row", model.name, exc)
            return
        if all(np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in pairs):
            model.batcher.positions = 0
        else:
            log.warning("%s: answers differ without mask slots; one slot a row", model.name)

    async def start(self) -> None:
        """Load every bundle (errors stop the start-up), then warm up in the background:
        /health/live answers at once, /health/ready only once every model is warm."""
        await asyncio.to_thread(self.load)
        for model in self.models.values():
            model.batcher.start()
        self._warming = asyncio.create_task(self._warm())

    async def _warm(self) -> None:
        try:
            if self.settings.warmup:
                await asyncio.to_thread(self.warm_up)
            for model in self.models.values():
                if isinstance(model.engine, Engine):
                    model.engine.warmed()
        except Exception as exc:
            # A model that cannot run its warm-up shapes will not serve: say so on liveness,
            # so Kubernetes restarts the pod instead of keeping a process that is never ready.
            log.exception("warm-up failed: liveness now fails")
            self.failed = f"warm-up failed: {type(exc).__name__}"
            return
        # What start-up made (modules, models, tokenizers) lives as long as the process: move it
        # out of the collector's sight. Otherwise each full collection walks all of it, finding
        # next to nothing, and under a flood they came every few seconds and held the event loop
        # up to 122 ms each (docs/performance.md).
        gc.collect()
        gc.freeze()
        self.warmed = True
        self.metrics.ready.set(1)

    async def stop(self) -> None:
        self.metrics.ready.set(0)
        if self._warming is not None:
            self._warming.cancel()
        for model in self.models.values():
            await model.batcher.stop()
