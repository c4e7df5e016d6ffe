"""What the app holds while it runs: the model table (service.models), admission
(service.admission), readiness, liveness and draining, and the start-up that loads, warms
(service.warmup) and freezes."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field
from typing import Any

from bertserve.runtime.batching import Activity
from bertserve.runtime.bundle import BundleError, load_bundle_spec
from bertserve.runtime.engine import Engine
from bertserve.service.admission import Admission
from bertserve.service.control import ModelControl
from bertserve.service.http.auth import PUBLIC_PATHS
from bertserve.service.http.errors import NotFound, NotLoaded, NotReady, RequestError
from bertserve.service.metrics import Metrics
from bertserve.service.models import NAME, Model, defaults, serving
from bertserve.service.process.memory import Trimmer
from bertserve.service.settings import Settings
from bertserve.service.tenants import Held, Tenant, places
from bertserve.service.warmup import warm_up

log = logging.getLogger(__name__)


class Slot:
    """An admitted API request's place, taken and released by this one object: while its body
    arrives it only counts as `receiving`; once the body is complete (`take`, by the protocol)
    it holds an in-flight slot, until it is answered or its client leaves (`release`, by the
    app). A request still sending its body holds no in-flight slot, so slow bodies cannot
    crowd out requests that can run (64 of them locked every keyed user out for 29 s); the
    bodies arriving at once are bounded on their own (`max_receiving`). The drain waits for
    both. Each step happens at most once, in this order.

    A body that completes when every in-flight slot is taken is refused then (`refused`,
    answered by the app's BodyLimit), so the cap holds, unless it is a task's request
    (`may_queue`) and a queued place is free (`ServiceState.queue_room`), while the task's
    model has room in its bulk lane (service.admission): then it is `queued`, and the handler
    serves it only if it is a client batch, whose rows wait in the batcher's bulk lane behind
    the interactive ones; a request of one input is refused there
    as at the cap (service.handler). A client batch that took an in-flight slot moves to a
    queued place too, once the handler knows it for one (`batch`): the cap is for requests of
    one input and those not yet read. A burst of client batches (llama-index sends every batch
    of an indexing job at once) waits for the model instead of meeting 503s, while requests
    of one input keep the bound on their latency."""

    __slots__ = ("held", "may_queue", "size", "stage", "state", "tenant")
    RECEIVING, IN_FLIGHT, QUEUED, DONE, REFUSED = range(5)

    def __init__(
        self,
        state: ServiceState | None,
        may_queue: bool = False,
        size: int = -1,
        tenant: Tenant | None = None,
    ) -> None:
        """`size`: the body's Content-Length (-1: chunked, counted as the largest body), what a
        queued place holds against `max_queued_bytes`. `tenant`: whose (service.tenants; None:
        a key that matched none, refused by the key check next), its places counted against
        its shares where several tenants share the process (`held`)."""
        self.state, self.stage, self.may_queue = state, self.RECEIVING, may_queue
        self.size = 0
        self.tenant = tenant
        self.held: Held | None = None
        if state is not None:
            self.size = state.body_size(size)
            state.receiving += 1
            if tenant is not None and state.places:
                self.held = state.places[tenant.name]
                self.held.receiving += 1

    def _queue(self, state: ServiceState) -> None:
        self.stage = self.QUEUED
        state.queued += 1
        state.queued_bytes += self.size
        if self.held is not None:
            self.held.queued += 1

    def take(self) -> None:
        state = self.state
        if state is None or self.stage != self.RECEIVING:
            return
        state.receiving -= 1
        held = self.held
        if held is not None:
            held.receiving -= 1
        settings = state.settings
        if state.in_flight - state.queued < settings.max_in_flight and (
            held is None or held.running < held.running_cap
        ):
            self.stage = self.IN_FLIGHT
            if held is not None:
                held.running += 1
        elif self.may_queue and state.queue_room(self.size, held):
            self._queue(state)
        else:
            self.stage = self.REFUSED
            return
        state.activity.begin()
        state.metrics.in_flight.inc()

    @property
    def refused(self) -> bool:
        """Its body completed when every in-flight slot was taken: answer 503, run nothing."""
        return self.stage == self.REFUSED

    @property
    def queued(self) -> bool:
        """Admitted past the in-flight cap: served only as a client batch."""
        return self.stage == self.QUEUED

    def batch(self) -> None:
        """The request is a client batch: it waits in the bulk lane, and gives its in-flight
        slot back to requests of one input if a queued place is free (200 concurrent client
        batches would otherwise take every slot, and a single request meet the cap)."""
        state = self.state
        if (
            state is not None
            and self.stage == self.IN_FLIGHT
            and state.queue_room(self.size, self.held)
        ):
            if self.held is not None:
                self.held.running -= 1
            self._queue(state)

    def release(self) -> None:
        state, stage = self.state, self.stage
        if state is None or stage in (self.DONE, self.REFUSED):
            return
        self.stage = self.DONE
        held = self.held
        if stage == self.RECEIVING:
            state.receiving -= 1
            if held is not None:
                held.receiving -= 1
            return
        if stage == self.QUEUED:
            state.queued -= 1
            state.queued_bytes -= self.size
            if held is not None:
                held.queued -= 1
        elif held is not None:
            held.running -= 1
        state.activity.end()
        state.metrics.in_flight.dec()


FREE = Slot(None)  # the probes' and /metrics': they answer from memory and hold nothing


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    models: dict[str, Model] = field(default_factory=dict)
    warmed: bool = False
    failed: str | None = None  # why start-up failed after the server bound: liveness says so
    draining: bool = False
    defaults: dict[str, Model] = field(default_factory=dict)  # task -> the model without ?model=
    worker: int | None = None  # this process's slot among the supervisor's workers
    peers_ready: Callable[[], bool] = lambda: True  # every worker ready (workers > 1)
    retiring: bool = False  # replaced for its memory: finishing its connections (server.py)
    # Started in another worker's place: the start-up (and so accepting) waits for warm-up.
    warm_first: bool = False
    grpc_port: int | None = None  # where the gRPC server listens, once started (service.grpc)
    tracing: Any = None  # service.tracing.Tracing where BERTSERVE_OTLP_ENDPOINT is set
    # The engine process's socket, where one runs the models for all workers (given by the
    # supervisor); empty: this process runs its own.
    engine_address: str = ""
    trimmer: Trimmer = field(default_factory=Trimmer)
    # API requests in flight, here (`in_flight`) and, as a supervisor's worker, in the other
    # workers: a lone one's model call may take every core (runtime.batching.Activity).
    activity: Activity = field(default_factory=Activity)
    # Admitted API requests whose body is still arriving (Slot): this process's count in
    # `receivers` at `activity.slot` (a list here; a supervisor's worker keeps it in the shared
    # array, so the lost-requests count of a worker killed includes them).
    receivers: MutableSequence[int] = field(default_factory=lambda: [0])
    queued: int = 0  # client batches admitted past max_in_flight, among in_flight (Slot)
    queued_bytes: int = 0  # their bodies' sizes, by Content-Length (Slot)
    _warming: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings)
        limits = self.settings
        # Each tenant's places and caps (service.tenants), where several share the process.
        self.places = places(
            limits.tenants, limits.max_receiving, limits.max_in_flight, limits.max_queued_batches
        )
        self.control = ModelControl(self)  # what is loaded, changed while serving (explicit)

    def admit(
        self,
        method: str,
        path: str,
        connections: int = 0,
        size: int = -1,
        given: list[bytes] | None = None,
    ) -> RequestError | Slot:
        """The gate, decided once a request (service.admission): why it is answered at once,
        or the admitted request's Slot (an in-flight slot once its body is complete). `size`:
        the body's Content-Length, -1 if it declared none. `given`: its Authorization headers,
        which name its tenant (service.tenants; None: the anonymous tenant's)."""
        if path in PUBLIC_PATHS:
            return self.admission.refusal(self, method, path, connections, size) or FREE
        tenant = self.settings.tenants.of(given or [])
        held = self.places.get(tenant.name) if tenant is not None and self.places else None
        refusal = self.admission.refusal(self, method, path, connections, size, held)
        if refusal is not None:
            return refusal
        return Slot(self, self.admission.may_queue(method, path, size), size, tenant)

    def body_size(self, declared: int) -> int:
        """What a body declared as `declared` bytes (-1: chunked) may hold: at most
        max_body_bytes, which a chunked body counts as."""
        limit = self.settings.max_body_bytes
        return min(declared, limit) if declared >= 0 else limit

    def queue_room(self, size: int, held: Held | None = None) -> bool:
        """A queued place is free for a body of `size` bytes: fewer than max_queued_batches,
        their bodies within max_queued_bytes (Slot), and `held`'s tenant within its share."""
        settings = self.settings
        return (
            self.queued < settings.max_queued_batches
            and self.queued_bytes + size <= settings.max_queued_bytes
            and (held is None or held.queued < held.queued_cap)
        )

    @property
    def unanswered(self) -> int:
        """Admitted API requests not yet answered: in flight, or still sending their body."""
        return self.in_flight + self.receiving

    @property
    def receiving(self) -> int:
        return self.receivers[self.activity.slot]

    @receiving.setter
    def receiving(self, value: int) -> None:
        self.receivers[self.activity.slot] = value

    @property
    def in_flight(self) -> int:
        """API requests admitted by this process and not yet answered: its count in
        `activity`."""
        return self.activity.counts[self.activity.slot]

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self.activity.counts[self.activity.slot] = value

    def serving(self) -> dict[str, list[str]]:
        """Task -> the names of the models serving it, the default first."""
        return serving(self.models)

    def load(self) -> None:
        """Load the start-up bundles (service.models): every one under settings.bundles, or
        with explicit model control those named (service.control)."""
        self.models = self.control.load_start()
        self.defaults = defaults(self.models)

    def warm_up(self) -> None:
        """Run representative shapes through every model (service.warmup)."""
        warm_up(self.models.values(), self.settings)

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
            and (bool(self.models) or self.settings.model_control == "explicit")
            and self.dead is None
            and all(m.batcher.alive for m in self.models.values())
        )

    @property
    def ready(self) -> bool:
        """Every serving process of this port is ready (one process: this one)."""
        return self.ready_here and self.peers_ready()

    def held(self, name: str) -> list[str] | None:
        """With explicit model control, the tasks of the repository's bundle `name` (None: no
        such bundle, or static control): what a 404 for a model not loaded says."""
        directory = self.settings.bundles / name
        if self.settings.model_control != "explicit" or not NAME.fullmatch(name):
            return None
        try:
            return load_bundle_spec(directory).tasks
        except BundleError:
            return None

    def model_for(self, task: str, name: str | None) -> Model:
        # Draining is the gate's to refuse (service.admission): a request it admitted before
        # the signal, whose body arrived after, is served like any other.
        if not self.warmed:
            raise NotReady("the service is starting: models are not loaded and warm yet")
        if name is not None:
            model = self.models.get(name)
            if model is None or task not in model.spec.tasks:
                serving = [m.name for m in self.models.values() if task in m.spec.tasks]
                if model is None:
                    held = self.held(name)
                    if held is not None and task not in held:
                        raise NotFound(
                            f"model {name!r} (in the repository, not loaded) has no {task} "
                            f"head: it serves {', '.join(held)}; models for {task}: {serving}"
                        )
                    if held is not None:
                        raise NotLoaded(
                            f"model {name!r} is not loaded (the repository holds it: POST "
                            f"/models/{name}/load with an admin key); models for {task}: "
                            f"{serving}",
                            name,
                        )
                    raise NotFound(f"no model {name!r}; models for {task}: {serving}")
                raise NotFound(
                    f"model {name!r} ({model.spec.architecture.model_type}) has no {task} head: "
                    f"it serves {', '.join(model.spec.tasks)}; models for {task}: {serving}"
                )
            return model
        default = self.defaults.get(task)
        if default is None:
            raise NotFound(f"no loaded bundle serves {task} (see GET /models)")
        return default

    async def start(self) -> None:
        """Load every bundle (errors stop the start-up), then warm up in the background:
        /health/live answers at once, /health/ready only once every model is warm. With
        `warm_first` the start-up, and so the server's accepting, waits for the warm-up, and a
        failed one stops the process."""
        await asyncio.to_thread(self.load)
        for model in self.models.values():
            model.batcher.start()
        self.control.started()
        self._warming = asyncio.create_task(self._warm())
        if self.warm_first:
            await asyncio.shield(self._warming)
            if self.failed is not None:
                raise RuntimeError(self.failed)

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
        # (docs/performance.md#choices-and-the-measurement-behind-each).
        gc.collect()
        gc.freeze()
        self.warmed = True
        self.control.warmed()
        self.metrics.ready.set(1)

    async def stop(self) -> None:
        self.metrics.ready.set(0)
        if self._warming is not None:
            self._warming.cancel()
        await self.control.stop()
        for model in self.models.values():
            await model.batcher.stop()
