"""The dynamic batcher: one queue per model, admission control, length-grouped batches under a
token budget, and one worker thread that runs the model off the event loop.

A request enqueues its sequences (`Row`s: a client batch, or a long text's windows) and awaits
them. Two kinds share one queue: interactive requests (one input) are admitted while the queue
holds at most `max_queue_wait_ms` of their work and go first into every batch; client batches
(more than one input: an indexer's traffic) queue behind them up to `max_bulk_queue_rows`
instead of being refused at that bound.

When the model is free, the batching loop takes what is queued: batches form while the model
is busy, so a lone request never waits for company and a loaded server runs full batches. A call
holding only client batches' rows runs in a lane of its own, beside the loop's other calls (one
such call at a time, on its own thread, niced): a request of one input never waits for an
indexer's call to end.
With `max_wait_ms` > 0 it also waits, up to that long after the oldest row arrived, for a batch
to fill (row cap or token budget). It drops rows whose request was cancelled (client gone),
whose deadline passed or would pass before the call ends (504: a request's own timeout, capped
by `request_timeout_s`), or whose first call would end past `max_queue_time_ms` (429 with
Retry-After: admission's estimate of the wait was outrun), and picks the row of the highest
priority (`PRIORITIES`: lower is first; a row rises a level for every `priority_aging_s` it has
waited; the oldest among equals) plus the rows of its kind and priority or above
closest to it in length, so padding stays small. It stops adding
rows where the padding they bring costs more model time than another call would (`CallCost`,
measured as it serves): a client batch of sentences of every length runs as a few calls of
similar lengths, not one call padded to its longest. The model runs on a single worker thread;
ONNX Runtime's own threads use the cores. A failed call fails the rows of that batch only; if
the loop itself dies it is restarted and readiness is false until it is.

A lone request, one row with nothing queued behind it and no other request in flight in any process
on these cores (`Activity`), runs alone: on the backend's lone session, which has every core
(runtime.engine). So do the calls of a request of many rows (a long document's chunks) while it is
the only request in flight, and client batches' calls while no other process has one. A lone
call that costs little runs on the event loop's own thread, since handing a short call to the
model's thread and its answer back costs a large share of the call
(docs/performance.md#what-limits-it); the loop waits for that one call, so only a call measured to
take at most `LoneCost.INLINE_S` does (a heavy one on the loop held /health/live for 600 ms). A
heavier lone call goes to the model's thread, still on the lone session. Everything else runs as
above.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableSequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from bertserve.runtime.errors import (
    BackendError,
    ClientGone,
    DeadlineExceeded,
    NotReady,
    Overloaded,
)
from bertserve.runtime.fairness import ANONYMOUS, Fairness

log = logging.getLogger(__name__)


class Backend(Protocol):
    """A model: `run(feeds)`, and where a batch's rows want outputs computed only on demand,
    `run(feeds, extra=names)`; a backend that runs alone also takes `alone=True`."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Activity:
    """Requests in flight on the cores this process shares: one count a process, in `counts`
    (a list here; the supervisor's shared array across its workers), this process's at
    `slot`. The service counts a request from its admission to its answer (`begin`, `end`, on
    the event loop; each process writes only its own count).

    `alone()`: at most one request in flight anywhere, so a call for it may take every core
    (a backend's lone session: `runtime.engine.Engine.runs_alone`). A count of model calls
    would not do: under load each worker's calls leave gaps (answers written, requests read)
    in which the other worker finds no call running. With nobody counting (the batcher on its
    own) every lone row runs alone."""

    def __init__(self, counts: MutableSequence[int] | None = None, slot: int = 0) -> None:
        self.counts = counts if counts is not None else [0]
        self.slot = slot

    def alone(self) -> bool:
        return sum(self.counts) <= 1

    def others_idle(self) -> bool:
        """No request in flight in any other process on these cores."""
        return sum(self.counts) == self.counts[self.slot]

    def begin(self) -> None:
        self.counts[self.slot] += 1

    def end(self) -> None:
        self.counts[self.slot] -= 1


@dataclass
class Row:
    """One sequence to run: unpadded ids (and, for fill-mask graphs, positions to score)."""

    input_ids: np.ndarray  # (S,) int64
    token_type_ids: np.ndarray  # (S,) int64
    mask_positions: np.ndarray | None = None  # (P,) int64
    # Outputs computed only on demand (runtime.capabilities.ON_DEMAND) that this row needs: the
    # call of any batch holding it computes them, for every row of it.
    wants: tuple[str, ...] = ()
    # The leading positions attended (None: all): a ColBERT query's [MASK] expansion is input
    # the model reads at positions nothing attends to (runtime/tasks/multivector.py).
    attend: int | None = None
    # The request's trace where it is traced (service.tracing.RowTrace: `.context`, and
    # `.tracing.batch(...)`, which writes the model call's span); opaque here.
    trace: Any = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class RowResult:
    outputs: dict[str, np.ndarray]  # this row's slice of every output, padding removed
    queue_s: float
    inference_s: float
    batch: Any = None  # the traced model call's span context (Row.trace), else None


@dataclass
class _Request:
    """What a request's rows share: whether any of them has been handed to the model, and
    whether it is a client batch (bulk: its own admission bound, and interactive rows go
    first)."""

    started: bool = False
    bulk: bool = False
    priority: int = 0  # PRIORITIES: lower goes first
    tenant: str = ANONYMOUS  # whose (runtime.fairness): its share of the queue and the model
    weight: float = 1.0


@dataclass
class _Item:
    row: Row
    future: asyncio.Future[RowResult]
    deadline: float
    request: _Request
    enqueued: float = field(default_factory=time.monotonic)
    tag: float = 0.0  # its virtual finish (runtime.fairness): the least goes first in its priority


class CallCost:
    """What one more model call costs, in tokens' worth of model time: `overhead_tokens()`.

    Fitted as the model serves: the time of a call (in the inference thread) against its padded
    tokens, by exponentially weighted least squares, gives a fixed cost a call and a cost a
    token; the time of a cycle around the call (the event loop's turn, padding, handing out
    results) is fixed cost too. A batch gains from a row that pads it by fewer slots than that.
    None until a spread of batch sizes has been measured: then nothing is split."""

    DECAY = 0.98  # weight of the older batches: about the last fifty count
    LARGE_TOKENS = 1024  # a call this large: its fixed cost is a small part of its time

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.around_s = 0.0
        # Seconds a token in large calls (batched, or a client batch's alone) by the call's padded
        # length, averaged: the cost of a token while the fit has no spread of sizes (a
        # reranker's full batches are alike). By length, as attention makes a long row's token
        # dearer than a short row's.
        self.by_length: dict[int, float] = {}

    def note_large(self, feeds: dict[str, np.ndarray], call_s: float) -> None:
        """A call's time towards `by_length`, if it had at least LARGE_TOKENS padded tokens."""
        rows, length = feeds["input_ids"].shape
        if rows * length >= self.LARGE_TOKENS:
            rate = call_s / (rows * length)
            old = self.by_length.get(length)
            self.by_length[length] = rate if old is None else 0.8 * old + 0.2 * rate

    def large_seconds(self, lengths: list[int]) -> float:
        """What rows of `lengths` tokens cost at the rate of a token in large calls of each
        row's length: interpolated between the lengths measured, the nearest beyond them; 0
        before any is measured."""
        if not self.by_length:
            return 0.0
        measured = sorted(self.by_length)
        rows = np.asarray(lengths, dtype=np.float64)
        rates = np.interp(rows, measured, [self.by_length[n] for n in measured])
        return float((rows * rates).sum())

    def observe(self, tokens: int, call_s: float, cycle_s: float) -> None:
        d = self.DECAY
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + call_s
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * call_s
        around = max(cycle_s - call_s, 0.0)
        self.around_s = around if self.w < 1.5 else 0.8 * self.around_s + 0.2 * around

    def seconds_per_token(self) -> float | None:
        """The fitted cost of one more token in a call; None until a spread of sizes is
        measured."""
        spread = self.w * self.sxx - self.sx * self.sx  # w^2 x the variance of the sizes
        if self.w < 8 or spread <= 0.01 * self.w * self.sxx:
            return None
        per_token = (self.w * self.sxy - self.sx * self.sy) / spread
        return per_token if per_token > 0 else None

    def overhead_tokens(self) -> float | None:
        per_token = self.seconds_per_token()
        if per_token is None:  # too few sizes measured, or nearly alike
            return None
        fixed = max((self.sy - per_token * self.sx) / self.w, 0.0)
        return (fixed + self.around_s) / per_token


class LoneCost:
    """Whether a lone call may run on the event loop's thread: its padded tokens times the cost
    of a token in lone calls, as measured (the highest recent rate, decaying by DECAY a call:
    a short call's fixed cost makes its rate high, which errs towards the model's thread), is
    at most INLINE_S. A call with more fill-mask slots than any call measured within INLINE_S
    (each slot is a vocabulary-wide product that the token rate does not see: 126 of them took
    400-700 ms), or before anything is measured, goes to the model's thread."""

    INLINE_S = 0.01  # a fifth of the 50 ms liveness bound (docs/security.md#what-the-defaults-are)
    DECAY = 0.95

    def __init__(self) -> None:
        self.per_token: float | None = None
        self.slots = 0  # the most fill-mask slots a call measured within INLINE_S had

    def observe(self, feeds: dict[str, np.ndarray], seconds: float) -> None:
        tokens, slots = self._size(feeds)
        rate = seconds / max(tokens, 1)
        self.per_token = rate if self.per_token is None else max(rate, self.DECAY * self.per_token)
        if seconds <= self.INLINE_S:
            self.slots = max(self.slots, slots)

    def inline(self, feeds: dict[str, np.ndarray]) -> bool:
        tokens, slots = self._size(feeds)
        return (
            self.per_token is not None
            and slots <= self.slots
            and tokens * self.per_token <= self.INLINE_S
        )

    @staticmethod
    def _size(feeds: dict[str, np.ndarray]) -> tuple[int, int]:
        slots = feeds.get("mask_positions")
        return feeds["input_ids"].size, 0 if slots is None else slots.size


class Limits(Protocol):
    """The batcher's settings (the service's `Settings` has them; any object with them does)."""

    @property
    def max_batch_rows(self) -> int: ...
    @property
    def max_batch_tokens(self) -> int: ...
    @property
    def max_wait_ms(self) -> float: ...
    @property
    def split_batches(self) -> bool: ...
    @property
    def max_queue_rows(self) -> int: ...
    @property
    def max_queue_wait_ms(self) -> float: ...
    @property
    def max_queue_time_ms(self) -> float: ...
    @property
    def max_bulk_queue_rows(self) -> int: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def bulk_nice(self) -> int: ...
    @property
    def default_priority(self) -> int: ...
    @property
    def bulk_priority(self) -> int: ...
    @property
    def priority_aging_s(self) -> float: ...


class Labelled(Protocol):
    def labels(self, *values: str) -> Any: ...


class BatchMetrics(Protocol):
    """The Prometheus families the batcher reports to (service/metrics.py's `Metrics`)."""

    @property
    def dropped(self) -> Labelled: ...
    @property
    def queue_depth(self) -> Labelled: ...
    @property
    def batch_rows(self) -> Labelled: ...
    @property
    def batch_tokens(self) -> Labelled: ...
    @property
    def padding(self) -> Labelled: ...
    @property
    def failed_batches(self) -> Labelled: ...
    @property
    def lone_calls(self) -> Labelled: ...
    @property
    def unanswered_model_seconds(self) -> Labelled: ...
    @property
    def tenant_rows(self) -> Labelled: ...


class Batcher:
    def __init__(
        self,
        name: str,
        backend: Backend,
        settings: Limits,
        metrics: BatchMetrics,
        output_axes: Mapping[str, str],
        pad_id: int,
        positions: int | None,
        activity: Activity | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.name = name
        # Padded tokens a call may hold: the setting, or less where the model says
        # (service.models.call_tokens: a vocabulary-wide head's intermediate grows with them).
        self.max_tokens = min(settings.max_batch_tokens, max_tokens or settings.max_batch_tokens)
        self.backend = backend
        # A lone request (one row, nothing queued here, no other request in flight anywhere)
        # runs on every core where the backend has a session for it (Activity).
        self.activity = activity or Activity()
        self.settings = settings
        self.metrics = metrics
        self.output_axes = output_axes  # bundle.json: how each output's rows are sliced
        self.pad_id = pad_id
        # The graph's mask_positions input: None, it has none; else the least width to send
        # (0 once the warm-up has seen the graph run without slots: service.warmup.probe_slots).
        self.positions = positions
        self._items: list[_Item] = []
        self._bulk = 0  # rows of client batches among _items
        # Interactive rows among _items that their own timer ended (_expire) since the last
        # sweep (_select): no longer work, so admission does not count them.
        self._expired = 0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-{name}")
        # Calls of client batches' rows alone run in their own lane, on a thread of their own
        # (_loop), of lower OS priority: where they share the cores with interactive work (this
        # model's own calls, another model's, the event loop), the kernel gives that work the
        # CPU first; alone, they run as fast (bulk_nice).
        nice = settings.bulk_nice
        self._bulk_executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"bulk-{name}",
            initializer=lower_priority,
            initargs=(nice,),  # 0: as it is
        )
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._running: list[_Item] = []  # the batch the model has now
        # Client batches' lane: a call holding only their rows runs beside the main loop's
        # calls (its own thread), so a request of one input never waits for one to end. Not
        # for a backend that runs one call at a time (`serial`: an engine process's client),
        # where a second call would only wait for the first and its time be measured as work.
        self._lanes = not getattr(backend, "serial", False)
        self._lane: asyncio.Task[None] | None = None
        self._lane_running: list[_Item] = []
        self._cycle_start = time.monotonic()
        self._stopping = False
        self.restarts = 0
        self.consecutive_failures = 0  # model calls that raised since the last that did not
        self.rows_per_s = 0.0  # measured drain rate (EWMA over cycles); 0: none measured yet
        self.cycle_s = 0.0  # measured time of one batch cycle (EWMA); 0: none measured yet
        self.cost = CallCost()  # what another call costs against padding (_select)
        self.fairness = Fairness()  # tenants' shares of this queue (runtime.fairness)
        self.lone_cost = LoneCost()  # what a lone call costs the event loop if it runs there
        # Labelled children bound once: `labels()` costs a lock and a lookup on every call.
        self._dropped = {
            r: metrics.dropped.labels(name, r) for r in ("cancelled", "expired", "overdue")
        }
        self._unanswered = {
            r: metrics.unanswered_model_seconds.labels(name, r) for r in ("cancelled", "expired")
        }
        self._overdue = (
            f"model {name}: queued too long to answer within {settings.max_queue_time_ms:g} ms "
            "(the limit); retry shortly"
        )
        self._depth = metrics.queue_depth.labels(name)
        self._rows = metrics.batch_rows.labels(name)
        self._tokens = metrics.batch_tokens.labels(name)
        self._padding = metrics.padding.labels(name)
        self._failed = metrics.failed_batches.labels(name)
        self._lone_calls = metrics.lone_calls.labels(name)
        self._tenant_rows: dict[str, Any] = {}  # by tenant: its rows handed to the model
        self._depth.set(0)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name=f"batcher-{self.name}")
        self._task.add_done_callback(self._on_loop_exit)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self._watch(), name=f"deadlines-{self.name}")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        if self._stopping or task.cancelled():
            return
        log.error("batching loop for %s died: %r; restarting", self.name, task.exception())
        self._fail_all(NotReady(f"model {self.name}: batching worker restarted, retry"))
        self.restarts += 1
        self.start()

    async def stop(self) -> None:
        self._stopping = True
        running = [*self._running, *self._lane_running]  # the calls' own cleanup empties these
        tasks = [t for t in (self._task, self._watchdog, self._lane) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all(NotReady("shutting down"))
        for item in running:
            if not item.future.done():
                item.future.set_exception(NotReady("shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._bulk_executor.shutdown(wait=False, cancel_futures=True)

    @property
    def depth(self) -> int:
        return len(self._items)

    @property
    def expected_wait_s(self) -> float:
        """How long the interactive rows queued would take to clear at the rate this model has
        been serving rows (0 before the first measured batch): they go before client batches'."""
        return self._clear_s(len(self._items) - self._bulk - self._expired)

    def _clear_s(self, rows: int, share: float = 1.0) -> float:
        """How long `rows` queued rows take to clear at `share` of the rate this model has been
        serving rows (0 before the first measured batch)."""
        return rows / (self.rows_per_s * share) if self.rows_per_s else 0.0

    def work_s(self, rows: list[Row]) -> float:
        """At least how long the model takes for `rows`: their tokens at the marginal cost of a
        token in batched calls (`CallCost`), the calls' fixed cost left out; until calls of a
        spread of sizes are measured, at the cost of a token in large calls of its row's
        length; 0 before either is measured. A rate of whole cycles would not do:
        measured on requests of one input it makes a batched token look many times dearer than
        it is."""
        per_token = self.cost.seconds_per_token()
        if per_token:
            return sum(len(r) for r in rows) * per_token
        return self.cost.large_seconds([len(r) for r in rows])

    def refusal(
        self, rows: int = 1, bulk: bool = False, tenant: str = ANONYMOUS, weight: float = 1.0
    ) -> str | None:
        """Why `rows` more sequences of `tenant` would be refused (None: admitted).

        Interactive rows (a request of one input): the queue is at its row limit, or already
        holds more than `max_queue_wait_ms` of interactive work, so that what is admitted is
        answered in time and the rest is told at once to retry. Client batches (bulk): they
        queue behind the interactive rows up to `max_bulk_queue_rows`, and while the model can
        clear them within half of `request_timeout_s` at its measured rate: an indexer's
        batches wait instead of being refused, and interactive answers keep their bound.
        Beside other tenants' queued rows of its kind, a tenant has its share of each bound
        (runtime.fairness), its rows counted against it and drained at its share of the rate."""
        # Fixed texts (no counts): the protocol encodes each refusal once.
        fair = self.fairness
        share = fair.share(tenant, weight, bulk)
        shared = " for this tenant (its share)" if share < 1.0 else ""
        if bulk:
            limit = self.settings.max_bulk_queue_rows
            queued = self._bulk if share == 1.0 else fair.queued[(tenant, True)]
            if queued + rows > limit * share:
                return (
                    f"model {self.name} has {limit} client-batch sequences queued{shared} "
                    "(the limit)"
                )
            budget = self.settings.request_timeout_s / 2
            if queued and self._clear_s(queued, share) > budget:
                return f"model {self.name} has over {budget:g} s of client batches queued{shared}"
            return None
        limit = self.settings.max_queue_rows
        interactive = len(self._items) - self._bulk - self._expired
        queued = interactive if share == 1.0 else fair.queued[(tenant, False)]
        if queued + rows > limit * share:
            return f"model {self.name} has {limit} sequences queued{shared} (the limit)"
        wait_ms = self.settings.max_queue_wait_ms
        if wait_ms and queued and self._clear_s(queued, share) * 1000 > wait_ms:
            return f"model {self.name} has over {wait_ms:g} ms of work queued{shared} (the limit)"
        return None

    # --- requests -----------------------------------------------------------------------------

    def enqueue(
        self,
        rows: list[Row],
        bulk: bool = False,
        priority: int | None = None,
        deadline: float | None = None,
        tenant: str = ANONYMOUS,
        weight: float = 1.0,
    ) -> list[asyncio.Future[RowResult]]:
        """Queue a request's rows; one future a row. Raises 429 past the admission limit of its
        kind (`refusal`). Cancelling a future drops its row if the model has not taken it yet;
        a row still unanswered at the deadline fails with a 504 (`_watch`, or a timer of the
        request's own where its `deadline` (time.monotonic) comes before `request_timeout_s`'s).
        `priority`: PRIORITIES (None: the settings' default for its kind). `tenant`, of `weight`:
        whose rows (runtime.fairness)."""
        refused = self.refusal(len(rows), bulk, tenant, weight)
        if refused is not None:
            raise Overloaded(f"{refused}; retry shortly", retry_after_s=1)
        loop = asyncio.get_running_loop()
        latest = time.monotonic() + self.settings.request_timeout_s
        if priority is None:
            priority = self.settings.bulk_priority if bulk else self.settings.default_priority
        request = _Request(bulk=bulk, priority=priority, tenant=tenant, weight=weight)
        own = deadline is not None and deadline < latest
        deadline = deadline if deadline is not None and own else latest
        tags = self.fairness.tags(tenant, weight, priority, map(len, rows))
        items = [
            _Item(row, loop.create_future(), deadline, request, tag=tag)
            for row, tag in zip(rows, tags, strict=True)
        ]
        if own:  # sooner than the watchdog's period may notice: its own timer, so 504 on time
            timer = loop.call_at(loop.time() + deadline - time.monotonic(), self._expire, items)
            left = [len(items)]

            def answered(_: object) -> None:  # the last row answered: the timer goes
                left[0] -= 1
                if not left[0]:
                    timer.cancel()

            for item in items:
                item.future.add_done_callback(answered)
        self._items.extend(items)
        self._bulk += len(items) if bulk else 0
        self.fairness.queued[(tenant, bulk)] += len(items)
        self._depth.set(len(self._items))
        self._wake.set()
        return [item.future for item in items]

    async def submit(
        self,
        rows: list[Row],
        bulk: bool = False,
        priority: int | None = None,
        deadline: float | None = None,
        tenant: str = ANONYMOUS,
        weight: float = 1.0,
    ) -> list[RowResult]:
        """Enqueue a request's rows and wait for all of them (`enqueue`, then `gather`).
        Cancelling the awaiting task cancels its rows."""
        return await gather(self.enqueue(rows, bulk, priority, deadline, tenant, weight))

    def _expire(self, items: list[_Item]) -> None:
        """A request's own deadline: its rows still unanswered fail with a 504 (a row in the
        model's call is answered no more; queued ones are dropped before any model time)."""
        error = DeadlineExceeded(f"model {self.name}: no result within the request's timeout")
        running = {id(item) for item in (*self._running, *self._lane_running)}
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
                if not item.request.bulk and id(item) not in running:
                    self._expired += 1  # still in _items until the next sweep

    # --- the loop -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._cycle_start = time.monotonic()
        while True:
            interactive = len(self._items) > self._bulk
            lane_free = self._lane is None or not self._lanes
            if not interactive and not (self._bulk and lane_free):
                # Nothing to run: nothing queued, or only client batches' rows while their
                # lane's call runs.
                self._wake.clear()
                await self._wake.wait()
                self._cycle_start = time.monotonic()  # idle time is not serving time
                continue
            await self._fill()
            if not self._lanes:  # one call at a time, of any rows
                batch = self._select()
                if batch:
                    await self._call(batch)
                continue
            if self._lane is None and self._bulk:
                # Client batches' rows run in their own lane, beside the calls of requests of
                # one input, which never wait for them (bertserve bench mixed).
                batch = self._select(bulk=True)
                if batch:
                    self._lane = loop.create_task(self._call(batch, lane=True))
                    self._lane.add_done_callback(self._lane_done)
            if len(self._items) > self._bulk:
                batch = self._select(bulk=False)
                if batch:
                    await self._call(batch)

    def _lane_done(self, task: asyncio.Task[None]) -> None:
        self._lane = None
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("a client-batch call of %s failed: %r", self.name, task.exception())

    async def _call(self, batch: list[_Item], lane: bool = False) -> None:
        """One model call for `batch`: its rows' results (or the call's error) handed out, and
        what it measured noted. `lane`: in the client batches' lane, beside the main one. An
        error outside the model's call (a bug) fails the batch's rows still unanswered, then
        propagates: no row is left without an answer."""
        try:
            await self._run_batch(batch, lane)
        except BaseException:
            error = NotReady(f"model {self.name}: batching worker restarted, retry")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            raise

    async def _run_batch(self, batch: list[_Item], lane: bool) -> None:
        loop = asyncio.get_running_loop()
        # A cycle: from the end of the previous call of its lane (the lane's: its own start).
        cycle_start = time.monotonic() if lane else self._cycle_start
        feeds, lengths = self._pad(batch)
        # Calls that may take every core (the backend's lone session): a lone row (nothing
        # queued behind it) of the only request in flight anywhere, and client batches' rows
        # while no other process on these cores has a request in flight. A 2,048-text request
        # on one worker's one thread ran at 0.61x the rate of the same texts as 64 requests
        # spread over both workers (bertserve bench clients), and 8 connections of 16-text
        # batches read 152-166 sentences/s in half of six server starts, 300-315 in the
        # others, as if one worker did all the work (301-305 in four starts with this).
        # So do the rows of one request (a long document's chunks, a long text's windows)
        # while it is the only request in flight anywhere.
        lone = len(batch) == 1 and not self._items
        bulk = all(item.request.bulk for item in batch)
        one = all(item.request is batch[0].request for item in batch)
        alone = getattr(self.backend, "runs_alone", False) and (
            (one and self.activity.alone()) or (bulk and self.activity.others_idle())
        )
        started = time.monotonic()
        if lane:
            self._lane_running = batch
        else:
            self._running = batch
        if alone:
            self._lone_calls.inc()
        extra = tuple(sorted({name for item in batch for name in item.row.wants}))
        # A call with on-demand outputs (a head graph's: a vocabulary-wide product at every
        # position; the token states) goes to the model's thread: the token rate measured
        # is that of calls without them.
        inline = alone and lone and not extra and self.lone_cost.inline(feeds)
        try:
            if inline:  # on this thread: no hand-off to the model's thread and back
                outputs, call_s = self._run(feeds, alone, extra)
            else:
                executor = self._bulk_executor if bulk else self._executor
                outputs, call_s = await loop.run_in_executor(
                    executor, self._run, feeds, alone, extra
                )
        except Exception:  # the backend's failure fails this batch only
            # The error's text stays in the log: it may name files or memory addresses.
            log.exception("model %s failed a batch of %d", self.name, len(batch))
            self._failed.inc()
            self.consecutive_failures += 1
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(
                        BackendError(f"model {self.name} failed (logged with the request id)")
                    )
            return
        finally:
            if lane:
                self._lane_running = []
            else:
                self._running = []
        elapsed = time.monotonic() - started
        self.consecutive_failures = 0
        ended = started + elapsed
        for item in batch:  # model time nobody receives: each such row's share of the call
            if item.deadline < ended or item.future.done():
                reason = "expired" if item.deadline < ended else dropped_reason(item.future)
                self._unanswered[reason].inc(call_s / len(batch))
        traced = self._traced(batch, feeds, elapsed) if self._any_traced(batch) else None
        for i, item in enumerate(batch):
            if item.future.done():
                continue
            item.future.set_result(
                RowResult(
                    self._slice(outputs, i, lengths[i], item.row),
                    started - item.enqueued,
                    elapsed,
                    traced,
                )
            )
        now = time.monotonic()
        if (
            alone and lone and not extra
        ):  # on more threads than a loaded server has: not its rate under
            # load. A client batch's calls alone are measured: the bulk lane's time bound
            # (refusal) needs a rate, and they may be all the model runs.
            self.lone_cost.observe(feeds, call_s)
            self.cost.note_large(feeds, call_s)
            if not lane:
                self._cycle_start = now
            return
        # Rows served per second of a whole cycle (waiting for the loop, padding, the model,
        # handing out results): the rate the queue drains at, for admission (refusal()).
        sample = len(batch) / max(now - cycle_start, 1e-6)
        self.rows_per_s = sample if not self.rows_per_s else 0.8 * self.rows_per_s + 0.2 * sample
        cycle = now - cycle_start
        self.cycle_s = cycle if not self.cycle_s else 0.8 * self.cycle_s + 0.2 * cycle
        self.cost.observe(feeds["input_ids"].size, call_s, cycle)
        self.cost.note_large(feeds, call_s)
        if not lane:
            self._cycle_start = now

    @staticmethod
    def _any_traced(batch: list[_Item]) -> bool:
        return any(item.row.trace is not None for item in batch)

    def _traced(self, batch: list[_Item], feeds: dict[str, np.ndarray], elapsed: float) -> Any:
        """The model call's span (service.tracing), linked to each traced request it served."""
        traces = list({id(t): t for item in batch if (t := item.row.trace) is not None}.values())
        end_ns = time.time_ns()
        attributes = {
            "bertserve.model": self.name,
            "bertserve.rows": len(batch),
            "bertserve.tokens": int(feeds["input_ids"].size),
            "bertserve.requests": len({id(item.request) for item in batch}),
        }
        start_ns = end_ns - int(elapsed * 1e9)
        return traces[0].tracing.batch([t.context for t in traces], start_ns, end_ns, attributes)

    async def _watch(self) -> None:
        """Fail every row still unanswered past its request's deadline with a 504: rows in a
        model call that hangs, and rows queued behind it. One timer for the model, not one a
        request; a row's 504 comes at most a tenth of the timeout (or 1 s) late."""
        timeout = self.settings.request_timeout_s
        period = min(1.0, timeout / 10)
        error = f"model {self.name}: no result within {timeout:g} s"
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for item in (*self._running, *self._lane_running, *self._items):
                if now > item.deadline and not item.future.done():
                    item.future.set_exception(DeadlineExceeded(error))

    def _run(
        self, feeds: dict[str, np.ndarray], alone: bool = False, extra: tuple[str, ...] = ()
    ) -> tuple[dict[str, np.ndarray], float]:
        """The model call, on the model's thread, and how long it took there (`CallCost`)."""
        started = time.perf_counter()
        run: Any = self.backend.run
        options: dict[str, Any] = {"alone": True} if alone else {}
        if extra:
            options["extra"] = extra
        outputs = run(feeds, **options)
        return outputs, time.perf_counter() - started

    async def _fill(self) -> None:
        """Wait for more rows until the batch is full or the oldest row has waited max_wait."""
        max_wait = self.settings.max_wait_ms / 1000
        while True:
            live = [i for i in self._items if not i.future.done()]
            if not live:
                return
            longest = max(len(i.row) for i in live)
            full = (
                len(live) >= self.settings.max_batch_rows or len(live) * longest >= self.max_tokens
            )
            remaining = live[0].enqueued + max_wait - time.monotonic()
            if full or remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=remaining)
            except TimeoutError:
                return

    def _select(self, bulk: bool | None = None) -> list[_Item]:
        """The next call's rows (module docstring), after sweeping the queue; `bulk`: only
        client batches' rows (True: their lane's call), or none of them (False)."""
        now = time.monotonic()
        # The bound is on when a request's first call ends: the batch chosen now ends about a
        # cycle from now, so a request that has waited past the limit (and the batch window)
        # less a cycle is refused. It may always wait out the batch the model was busy with
        # when it arrived, as a slow model's batch can take longer than the bound itself: taken
        # as one and a half measured cycles, since a row that came just as that batch began has
        # waited a whole cycle and the loop's turn, which varies.
        window = self.settings.max_wait_ms / 1000
        limit_ms = self.settings.max_queue_time_ms
        overdue = (
            max(limit_ms / 1000 + window - self.cycle_s, window + 1.5 * self.cycle_s)
            if limit_ms
            else 0.0
        )
        live = []
        for item in self._items:
            if item.future.done():  # its client left, or its own timer ended it (_expire)
                self._dropped[dropped_reason(item.future)].inc()
            elif now > item.deadline:
                item.future.set_exception(
                    DeadlineExceeded(f"model {self.name}: deadline passed in the queue")
                )
                self._dropped["expired"].inc()
            elif (
                overdue
                and not item.request.started
                and not item.request.bulk
                and now - item.enqueued > overdue
            ):
                # Admission promised an answer within max_queue_wait_ms at the rate measured so
                # far; a loop swamped by a flood can make that rate a promise it cannot keep. A
                # quick "retry" beats a late answer. Only for a request none of whose rows has
                # run (they share the arrival, so all go in this pass): a long text's later
                # windows wait behind its first ones by design.
                item.future.set_exception(Overloaded(self._overdue, retry_after_s=1))
                self._dropped["overdue"].inc()
            else:
                live.append(item)
        if not live:
            self._requeue([])
            self._depth.set(0)
            return []
        eligible = live if bulk is None else [i for i in live if i.request.bulk == bulk]
        if not eligible:
            self._requeue(live)
            self._depth.set(len(live))
            return []
        # The priority of the row that ranks first goes first: the highest, or one that has
        # waited (a row rises a level for every priority_aging_s it has waited, so no priority
        # starves; client batches wait behind requests of one input by their default
        # priorities). Within it, the row of the least fair-queueing tag: the oldest, where one
        # tenant has rows waiting (runtime.fairness).
        aging = self.settings.priority_aging_s
        oldest = min(
            eligible, key=lambda item: item.request.priority - (now - item.enqueued) / aging
        )
        level = oldest.request.priority
        peers = [item for item in eligible if item.request.priority == level]
        first = min(peers, key=lambda item: (item.tag, item.enqueued))
        anchor = len(first.row)
        # Rows of a lower priority (a higher number) do not join: a call formed for an
        # interactive row stays its size, not a client batch's (beside an indexer, single
        # inputs otherwise waited for a full call of its rows: bertserve bench mixed). Of
        # several tenants' rows, only those within a call's tokens of the first row's tag.
        others = [item for item in eligible if item is not first and item.request.priority <= level]
        weights = {item.request.tenant: item.request.weight for item in peers}
        if len(weights) > 1:
            most = min(self.max_tokens, self.settings.max_batch_rows * anchor)  # a call's
            reach = first.tag + self.fairness.window(weights.values(), most)
            others = [i for i in others if i.request.priority < level or i.tag <= reach]
        by_closeness = sorted(others, key=lambda item: (abs(len(item.row) - anchor), item.tag))
        batch, longest = [first], anchor
        for item in by_closeness:
            new_longest = max(longest, len(item.row))
            if (
                len(batch) >= self.settings.max_batch_rows
                or (len(batch) + 1) * new_longest > self.max_tokens
            ):
                continue
            batch.append(item)
            longest = new_longest
        overhead = self.cost.overhead_tokens() if self.settings.split_batches else None
        if overhead is not None:
            batch = batch[: cheapest_prefix([len(item.row) for item in batch], overhead)]
        # No model time for a row whose answer would come after its deadline: it is answered
        # 504 now (a short timeout of its own; rows of the default deadline, past it, went above).
        # Twice the call's expected time: beside another worker's calls on shared cores a call
        # took up to twice the estimate (bertserve bench deadlines).
        ends = now + 2 * self.call_s(len(batch) * max(len(item.row) for item in batch))
        late = [item for item in batch if item.deadline < ends]
        for item in late:
            item.future.set_exception(
                DeadlineExceeded(f"model {self.name}: the request's timeout ends before its call")
            )
            self._dropped["expired"].inc()
        batch = [item for item in batch if item.deadline >= ends]
        for item in batch:
            item.request.started = True
        taken = {id(item) for item in (*batch, *late)}
        self._requeue([item for item in live if id(item) not in taken])
        self.fairness.served(level, first.tag)
        self._count_tenants(batch)
        self._depth.set(len(self._items) + len(batch))
        return batch

    def _requeue(self, items: list[_Item]) -> None:
        """The rows still queued after a sweep, and what is counted of them: the client
        batches' among them, every tenant's (runtime.fairness); none expired unswept."""
        self._items, self._expired = items, 0
        self._bulk = sum(1 for item in items if item.request.bulk)
        self.fairness.recount((item.request.tenant, item.request.bulk) for item in items)

    def _count_tenants(self, batch: list[_Item]) -> None:
        """bertserve_tenant_rows_total: each tenant's rows handed to the model."""
        counts: dict[str, int] = {}
        for item in batch:
            counts[item.request.tenant] = counts.get(item.request.tenant, 0) + 1
        for tenant, count in counts.items():
            child = self._tenant_rows.get(tenant)
            if child is None:
                child = self._tenant_rows[tenant] = self.metrics.tenant_rows.labels(
                    self.name, tenant
                )
            child.inc(count)

    def call_s(self, tokens: int) -> float:
        """How long a call of `tokens` padded tokens is expected to take: the fitted fixed cost
        and cost a token (`CallCost`), else the measured cycle; 0 before anything is measured."""
        per_token = self.cost.seconds_per_token()
        if per_token is None:
            return self.cycle_s
        fixed = max((self.cost.sy - per_token * self.cost.sx) / self.cost.w, 0.0)
        return fixed + per_token * tokens

    def _pad(self, batch: list[_Item]) -> tuple[dict[str, np.ndarray], list[int]]:
        feeds, lengths = pad_rows([item.row for item in batch], self.pad_id, self.positions)
        tokens = feeds["input_ids"].size
        self._rows.observe(len(batch))
        self._tokens.observe(tokens)
        self._padding.observe(1 - sum(lengths) / tokens)
        return feeds, lengths

    def _slice(
        self, outputs: dict[str, np.ndarray], i: int, length: int, row: Row
    ) -> dict[str, np.ndarray]:
        return slice_outputs(outputs, i, length, row, self.output_axes)

    def _fail_all(self, error: Exception) -> None:
        for item in self._items:
            if not item.future.done():
                item.future.set_exception(error)
        self._items, self._bulk, self._expired = [], 0, 0


def dropped_reason(future: asyncio.Future[RowResult]) -> str:
    """Why a queued row's future is done before its call: "expired" where its deadline ended it,
    else "cancelled" (its client left, or the request failed on another row)."""
    if not future.cancelled() and isinstance(future.exception(), DeadlineExceeded):
        return "expired"
    return "cancelled"


def lower_priority(nice: int) -> None:
    """Raise this thread's niceness by `nice` (Linux: a thread's own; elsewhere, or refused, it
    stays as it is)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        log.debug("could not lower the priority of %s", threading.current_thread().name)


async def gather(
    futures: list[asyncio.Future[RowResult]], gone: asyncio.Future[None] | None = None
) -> list[RowResult]:
    """The results of one request's rows, in order. The first row to fail fails the request;
    then, or if the awaiting task is cancelled, the rest are cancelled (a row not yet taken by
    the model costs nothing). `gone`: a future that completes when the client goes away; it
    cancels the rows and raises ClientGone. No task or timer a request: callbacks only."""

    def drop(_: object) -> None:
        for future in futures:
            future.cancel()

    if gone is not None:
        if gone.done():
            drop(None)
            raise ClientGone("client closed the connection")
        gone.add_done_callback(drop)
    try:
        if len(futures) == 1:  # the common case
            return [await futures[0]]
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [future.result() for future in futures]  # CancelledError if the rows were
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if gone is not None and gone.done() and not (task and task.cancelling()):
            raise ClientGone("client closed the connection") from None
        raise
    finally:
        if gone is not None:
            gone.remove_done_callback(drop)
        drop(None)  # no-op for rows done


def cheapest_prefix(lengths: list[int], overhead: float) -> int:
    """How many of a batch's rows (`lengths`: the oldest first, then by closeness to it) to run
    now: the prefix whose model time a real token, (overhead + rows x longest) / real tokens, is
    least. `overhead`: another call's fixed cost in tokens (`CallCost`). A row left out runs in a
    later batch, with rows nearer its length."""
    keep, cost, real_kept = 1, overhead + lengths[0], lengths[0]
    longest = real = 0
    for rows, length in enumerate(lengths, 1):
        longest, real = max(longest, length), real + length
        if (overhead + rows * longest) * real_kept <= cost * real:  # cheaper a token, or as cheap
            keep, cost, real_kept = rows, overhead + rows * longest, real
    return keep


def pad_rows(
    rows: list[Row], pad_id: int, positions: int | None
) -> tuple[dict[str, np.ndarray], list[int]]:
    """Right-pad rows into the graph's int64 inputs; returns (feeds, lengths). `positions`: None
    for a graph without a mask_positions input, else the least width of that input. A row
    without positions (an /nsp pair) takes none: a batch of such rows sends width 0 where the
    graph allows it, and the MLM head then runs on no rows at all."""
    lengths = [len(row) for row in rows]
    width, n = max(lengths), len(rows)
    feeds = {
        "input_ids": np.full((n, width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((n, width), dtype=np.int64),
        "token_type_ids": np.zeros((n, width), dtype=np.int64),
    }
    for i, row in enumerate(rows):
        feeds["input_ids"][i, : lengths[i]] = row.input_ids
        feeds["attention_mask"][i, : lengths[i] if row.attend is None else row.attend] = 1
        feeds["token_type_ids"][i, : lengths[i]] = row.token_type_ids
    if positions is not None:
        wanted = [r.mask_positions for r in rows if r.mask_positions is not None]
        slots = max([positions, *(len(p) for p in wanted)])
        feeds["mask_positions"] = np.zeros((n, slots), np.int64)  # padding scores position 0
        for i, r in enumerate(rows):
            if r.mask_positions is not None:
                feeds["mask_positions"][i, : len(r.mask_positions)] = r.mask_positions
    return feeds, lengths


def without_slots(
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    feeds: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray],
    axes: Mapping[str, str],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run `feeds` again with a mask_positions input of width 0 and pair each output that is
    not per mask position with its value in `outputs` (the run of `feeds` as they are): what
    decides whether /nsp rows may skip the MLM head on this graph and provider. Raises what
    `run` raises (a provider that refuses empty tensors)."""
    empty = run(feeds | {"mask_positions": feeds["mask_positions"][:, :0]})
    return [(outputs[n], empty[n]) for n in outputs if axes.get(n, "sequence") != "mask"]


def slice_outputs(
    outputs: dict[str, np.ndarray], i: int, length: int, row: Row, axes: Mapping[str, str]
) -> dict[str, np.ndarray]:
    """Row i's share of a batch's outputs, padding removed, by each output's declared axes:
    "sequence" (one value a row), "token" (one a position: the row's length), "mask" (one a
    requested position: the row's mask_positions)."""
    out = {}
    for name, value in outputs.items():
        kind = axes.get(name, "sequence")
        if kind == "token":
            out[name] = value[i, :length]
        elif kind == "mask":
            out[name] = value[i, : 0 if row.mask_positions is None else len(row.mask_positions)]
        else:
            out[name] = value[i]
    return out
