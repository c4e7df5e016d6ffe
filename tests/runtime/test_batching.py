"""The batching policy (`Batcher._select`) on its own: the oldest row always goes first, the
rows closest to it in length join it, the row cap and the token budget (rows x longest) hold,
cancelled or expired rows are dropped before they cost compute, and once a call's cost is
measured, rows whose padding would cost more than another call wait for a batch of their own;
a lone request runs alone (every core, on the event loop), and nothing else does."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bertserve.runtime.batching import (
    Activity,
    Batcher,
    CallCost,
    LoneCost,
    Row,
    _Item,
    _Request,
    cheapest_prefix,
    gather,
)
from bertserve.runtime.errors import ClientGone, DeadlineExceeded, NotReady, Overloaded


@dataclass(frozen=True)
class Settings:
    """The batcher's limits (runtime.batching.Limits), at the service's defaults."""

    max_batch_rows: int = 32
    max_batch_tokens: int = 8192
    max_wait_ms: float = 0.0
    split_batches: bool = True
    max_queue_rows: int = 512
    max_queue_wait_ms: float = 500.0
    max_queue_time_ms: float = 750.0
    max_bulk_queue_rows: int = 4096
    request_timeout_s: float = 30.0
    bulk_nice: int = 10
    default_priority: int = 0
    bulk_priority: int = 1
    priority_aging_s: float = 10.0


class Metrics:
    """The Prometheus families the batcher reports to (runtime.batching.BatchMetrics), in a
    registry of their own."""

    def __init__(self) -> None:
        r = CollectorRegistry()
        self.dropped = Counter("dropped", "", ["model", "reason"], registry=r)
        self.queue_depth = Gauge("queue_depth", "", ["model"], registry=r)
        self.batch_rows = Histogram("batch_rows", "", ["model"], registry=r)
        self.batch_tokens = Histogram("batch_tokens", "", ["model"], registry=r)
        self.padding = Histogram("padding", "", ["model"], registry=r)
        self.failed_batches = Counter("failed_batches", "", ["model"], registry=r)
        self.lone_calls = Counter("lone_calls", "", ["model"], registry=r)
        self.unanswered_model_seconds = Counter("unanswered", "", ["model", "reason"], registry=r)
        self.tenant_rows = Counter("tenant_rows", "", ["model", "tenant"], registry=r)

    def value(self, family: str, **labels: str) -> float:
        counter = getattr(self, family)
        return counter.labels(*labels.values())._value.get()


def select(
    lengths,
    *,
    rows=4,
    tokens=1000,
    cancelled=(),
    expired=(),
    cost=None,
    split=True,
    cap=None,
    priorities=None,
    waited=None,
    deadlines=None,
    cycle_s=0.0,
):
    """Queue rows of the given lengths (oldest first), pick one batch; returns the lengths of
    the batch in pick order, the lengths left queued, and the items. `priorities`, `waited`
    (seconds queued) and `deadlines` (seconds from now): one a row, where given."""

    async def run():
        loop = asyncio.get_running_loop()
        settings = Settings(max_batch_rows=rows, max_batch_tokens=tokens, split_batches=split)
        batcher = Batcher("m", None, settings, Metrics(), {}, 0, None, max_tokens=cap)
        batcher.cycle_s = cycle_s
        if cost is not None:
            batcher.cost = cost
        now = time.monotonic()
        items = []
        for i, n in enumerate(lengths):
            row = Row(np.full(n, 5, np.int64), np.zeros(n, np.int64))
            deadline = now - 1 if i in expired else now + 60
            if deadlines is not None:
                deadline = now + deadlines[i]
            # Rows that waited long are a client batch's: a single input's would be overdue.
            request = _Request(bulk=bool(waited), priority=priorities[i] if priorities else 0)
            enqueued = now - waited[i] if waited else now + i * 1e-3
            item = _Item(row, loop.create_future(), deadline, request, enqueued)
            if i in cancelled:
                item.future.cancel()
            items.append(item)
        batcher._items = list(items)
        batch = batcher._select()
        return [len(i.row) for i in batch], [len(i.row) for i in batcher._items], items

    return asyncio.run(run())


def test_a_models_own_token_cap_bounds_its_calls_below_the_setting():
    """A sparse model's calls on a CPU hold fewer tokens than max_batch_tokens
    (service.models.call_tokens): the batch stops at the model's cap, never above the setting."""
    assert select([100] * 8, rows=8, tokens=1000, cap=300, split=False)[0] == [100] * 3
    assert select([100] * 8, rows=8, tokens=250, cap=300, split=False)[0] == [100] * 2
    assert select([100] * 8, rows=8, tokens=1000, split=False)[0] == [100] * 8


def test_oldest_first_then_closest_in_length():
    batch, left, _ = select([50, 10, 48, 90, 52, 51], rows=4)
    assert batch == [50, 51, 48, 52]  # the oldest, then by |length - 50|, ties to the older
    assert left == [10, 90]


def test_the_oldest_row_goes_even_when_it_is_the_odd_one_out():
    batch, _, _ = select([200, 10, 10, 10], rows=4, tokens=210)
    assert batch == [200]  # no starvation: long rows are not passed over


def test_token_budget_counts_padding():
    # 3 rows padded to 40 = 120 tokens fit a budget of 120; a 4th (even of 10) would not.
    batch, left, _ = select([40, 38, 39, 10], rows=8, tokens=120)
    assert batch == [40, 39, 38] and left == [10]


def test_row_cap():
    batch, left, _ = select([8] * 10, rows=3)
    assert len(batch) == 3 and len(left) == 7


def test_the_highest_priority_goes_first_and_ageing_lifts_the_low_ones():
    """Lower numbers go first whatever their arrival; among equals the oldest; a row rises a
    level for every priority_aging_s (10 s) it has waited, so priority 3 that waited 31 s goes
    before priority 0 that just came, and 29 s is not enough."""
    # rows=1: each pick is the one row that goes first.
    assert select([10, 11, 12], rows=1, priorities=[2, 0, 1])[0] == [11]
    assert select([10, 11, 12], rows=1, priorities=[1, 1, 1], waited=[1, 3, 2])[0] == [11]
    assert select([10, 11], rows=1, priorities=[3, 0], waited=[31, 0])[0] == [10]
    assert select([10, 11], rows=1, priorities=[3, 0], waited=[29, 0])[0] == [11]
    # Rows of its priority or above join the first, the closest in length; lower ones do not.
    assert select([50, 10, 49, 12], rows=3, priorities=[5, 0, 5, 0])[0] == [10, 12]
    # A low priority lifted first by ageing takes the higher ones with it.
    assert select([50, 10, 49], rows=3, priorities=[5, 0, 0], waited=[60, 0, 0])[0] == [50, 49, 10]


def test_a_row_whose_deadline_ends_before_its_call_would_is_answered_504_unrun():
    """With a call measured to take 100 ms (the cycle), a row due in 50 ms is dropped before
    the call (504, counted expired) and the others run."""
    batch, left, items = select(
        [20, 21, 22], rows=8, deadlines=[60, 0.05, 60], cycle_s=0.1, split=False
    )
    assert batch == [20, 22] and left == []
    with pytest.raises(DeadlineExceeded, match="timeout ends before its call"):
        items[1].future.result()


def test_a_requests_own_timeout_answers_504_on_time_and_costs_no_model_time():
    """Behind a 300 ms call, a request with a 50 ms deadline of its own gets its 504 at about
    50 ms (its own timer, not the watchdog's 1 s period) and its row never reaches the model;
    a row whose deadline passes during its call counts that call's time as unanswered."""

    async def run():
        backend = Counting(0.3)
        metrics = Metrics()
        batcher = Batcher("m", backend, Settings(), metrics, {"logits": "row"}, 0, None)
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        first = asyncio.ensure_future(batcher.submit([row], deadline=time.monotonic() + 0.1))
        await asyncio.sleep(0.01)  # the first call has begun: 300 ms
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await batcher.submit([row], priority=0, deadline=started + 0.05)
        waited = time.monotonic() - started
        with pytest.raises(DeadlineExceeded):
            await first  # its deadline passed during its call: answered 504, not late
        await asyncio.sleep(0.35)  # the call ends; nothing else is run
        await batcher.stop()
        return waited, backend.calls, metrics

    waited, calls, metrics = asyncio.run(run())
    assert 0.04 < waited < 0.2
    assert calls == 1  # the second row never ran
    assert metrics.value("dropped", model="m", reason="expired") == 1
    assert 0.25 < metrics.value("unanswered_model_seconds", model="m", reason="expired") < 0.5


def test_rows_their_own_timer_ended_no_longer_count_against_admission():
    """Behind a 300 ms call, two rows of a 20 ms timeout fill a queue of two; once their
    timers end them they are no work, and the next request is admitted before any sweep."""

    async def run():
        batcher = Batcher(
            "m", Counting(0.3), Settings(max_queue_rows=2), Metrics(), {"logits": "row"}, 0, None
        )
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        first = asyncio.ensure_future(batcher.submit([row]))
        await asyncio.sleep(0.01)  # the first call has begun
        short = [batcher.enqueue([row], deadline=time.monotonic() + 0.02)[0] for _ in range(2)]
        full = batcher.refusal()
        await asyncio.sleep(0.05)  # their timers have run; the call has not ended
        after = batcher.refusal()
        await first
        await batcher.stop()
        return full, after, [type(f.exception()) for f in short]

    full, after, errors = asyncio.run(run())
    assert full == "model m has 2 sequences queued (the limit)"
    assert after is None
    assert errors == [DeadlineExceeded, DeadlineExceeded]


def test_a_single_input_does_not_wait_for_a_client_batchs_call():
    """Client batches' calls run in their own lane: a request of one input sent while a 300 ms
    call of a client batch runs is answered from a call of its own before that call ends."""

    async def run():
        batcher = Batcher("m", Counting(0.3), Settings(), Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        bulk = asyncio.ensure_future(batcher.submit([row, row], bulk=True))
        await asyncio.sleep(0.02)  # the client batch's call has begun
        started = time.monotonic()
        single = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        backend = batcher.backend
        backend.seconds = 0.01  # the single input's call is short
        await batcher.submit([single])
        waited = time.monotonic() - started
        done_before = bulk.done()
        await bulk
        await batcher.stop()
        return waited, done_before

    waited, bulk_done_first = asyncio.run(run())
    assert waited < 0.2 and not bulk_done_first


def test_stopping_answers_the_rows_of_a_call_in_flight():
    """stop() while a call runs: its rows are answered (503 not ready), none left waiting."""

    async def run():
        batcher = Batcher("m", Counting(0.3), Settings(), Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        pending = [
            asyncio.ensure_future(batcher.submit([row, row], bulk=True)),
            asyncio.ensure_future(batcher.submit([row])),
        ]
        await asyncio.sleep(0.05)
        await batcher.stop()
        return await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout=1)

    results = asyncio.run(run())
    assert [type(r) for r in results] == [NotReady, NotReady]


class Counting:
    """A model that takes `seconds` a call and counts its calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def run(self, feeds):
        self.calls += 1
        time.sleep(self.seconds)
        return {"logits": np.zeros((len(feeds["input_ids"]), 2), np.float32)}


def test_cancelled_and_expired_rows_are_dropped_before_compute():
    batch, left, items = select([20, 21, 22, 23], rows=8, cancelled={0}, expired={2})
    assert batch == [21, 23] and left == []
    with pytest.raises(DeadlineExceeded):
        items[2].future.result()


class SlowBackend:
    """A model that takes `seconds` a call and returns one logit pair a row."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self, feeds):
        time.sleep(self.seconds)
        return {"logits": np.zeros((len(feeds["input_ids"]), 2), np.float32)}


def test_admission_refuses_past_the_queued_work_the_model_can_clear_in_time():
    """With the drain rate measured (1 row per 20 ms call: ~50 rows/s), a queue holding more
    than max_queue_wait_ms of work refuses new rows, well before the row limit."""

    async def run():
        settings = Settings(max_batch_rows=1, max_queue_rows=1000, max_queue_wait_ms=100)
        batcher = Batcher("m", SlowBackend(0.02), settings, Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        assert batcher.refusal() is None and batcher.rows_per_s == 0  # nothing measured yet
        await asyncio.gather(*(batcher.submit([row]) for _ in range(5)))
        rate = batcher.rows_per_s
        pending = [asyncio.ensure_future(batcher.submit([row])) for _ in range(20)]
        await asyncio.sleep(0)
        wait = batcher.expected_wait_s
        results = await asyncio.gather(*pending, return_exceptions=True)
        await batcher.stop()
        return rate, [r for r in results if isinstance(r, Exception)], wait

    rate, refused, wait = asyncio.run(run())
    assert 25 < rate < 55  # 1 row / (20 ms + the loop's share of the cycle)
    assert 0.1 < wait < 0.3  # admitted up to ~100 ms of work, then refused
    assert 10 <= len(refused) <= 17
    assert {str(e) for e in refused} == {
        "model m has over 100 ms of work queued (the limit); retry shortly"
    }
    assert all(isinstance(e, Overloaded) for e in refused)


def test_client_batches_queue_behind_interactive_rows_within_their_own_bound():
    """A client batch (bulk) is admitted past the interactive work bound, up to its own row
    bound; a request of one input sent after it is answered before the batch's queued rows."""

    async def run():
        settings = Settings(
            max_batch_rows=1, max_queue_rows=1000, max_queue_wait_ms=100, max_bulk_queue_rows=64
        )
        batcher = Batcher("m", SlowBackend(0.02), settings, Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        await asyncio.gather(*(batcher.submit([row]) for _ in range(5)))  # rate measured
        bulk = batcher.enqueue([row] * 40, bulk=True)  # ~0.8 s of work: over 100 ms
        interactive = batcher.enqueue([row])[0]
        assert batcher.refusal() is None  # the interactive lane is empty
        refused = batcher.refusal(40, bulk=True)
        await interactive
        bulk_done_then = sum(f.done() for f in bulk)
        await asyncio.gather(*bulk)
        await batcher.stop()
        return refused, bulk_done_then

    refused, bulk_done_then = asyncio.run(run())
    assert refused == "model m has 64 client-batch sequences queued (the limit)"
    assert bulk_done_then <= 2  # the single went after at most the call already running


def measured(fixed_s: float, per_token_s: float, around_s: float) -> CallCost:
    """A CallCost that has seen calls of 100-1,600 tokens taking fixed + per_token x tokens."""
    cost = CallCost()
    for tokens in (100, 400, 1600, 800, 200, 1200, 300, 900, 1500, 600):
        call = fixed_s + per_token_s * tokens
        cost.observe(tokens, call, call + around_s)
    return cost


def test_call_cost_is_fitted_from_the_calls_it_sees():
    cost = measured(fixed_s=1e-3, per_token_s=1e-5, around_s=5e-4)
    assert cost.overhead_tokens() == pytest.approx(150, rel=1e-3)  # (1 + 0.5 ms) / 10 us
    # until a spread of sizes is seen there is no estimate, so nothing is split
    few, alike = CallCost(), CallCost()
    for _ in range(5):
        few.observe(100, 2e-3, 3e-3)
    for _ in range(20):
        alike.observe(512, 6e-3, 7e-3)
    assert few.overhead_tokens() is None and alike.overhead_tokens() is None
    flat = measured(fixed_s=2e-3, per_token_s=0.0, around_s=0.0)  # time does not grow
    assert flat.overhead_tokens() is None


def test_cheapest_prefix_stops_where_padding_costs_more_than_a_call():
    # another call costs 10 tokens: the 118 and 120 would pad 10-12 into 118s
    assert cheapest_prefix([10, 11, 9, 12, 118, 120], overhead=10) == 4
    assert cheapest_prefix([10, 11, 9, 12, 118, 120], overhead=1e6) == 6  # calls dear: all
    assert cheapest_prefix([30] * 8, overhead=0.5) == 8  # no padding: all, however cheap a call
    assert cheapest_prefix([60, 10], overhead=1) == 1  # the short one waits for its own kind


def test_rows_of_far_lengths_wait_for_a_batch_of_their_own_once_a_call_is_measured():
    """A client batch of short and long sentences: one call padded to the longest cost more
    than two calls of like lengths (measured: 1.24x the sequences/s on client batches of 16,
    docs/performance.md)."""
    cost = measured(fixed_s=1e-4, per_token_s=1e-5, around_s=0.0)  # a call = 10 tokens
    lengths = [10, 11, 9, 12, 118, 120]
    batch, left, items = select(lengths, rows=8, cost=cost)
    assert batch == [10, 11, 9, 12] and left == [118, 120]
    assert not items[4].request.started  # the long rows are still only queued
    batch, left, _ = select(lengths, rows=8, cost=cost, split=False)
    assert sorted(batch) == sorted(lengths) and left == []
    batch, left, _ = select(lengths, rows=8)  # nothing measured yet: as before
    assert sorted(batch) == sorted(lengths)


def test_the_batching_loop_measures_every_call():
    async def run():
        settings = Settings(max_batch_rows=4)
        batcher = Batcher("m", SlowBackend(0.002), settings, Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        for n in (1, 4, 2, 3, 4, 1, 2, 4, 3, 1):
            row = Row(np.full(8, 5, np.int64), np.zeros(8, np.int64))
            await batcher.submit([row] * n)
        await batcher.stop()
        return batcher.cost

    cost = asyncio.run(run())
    assert cost.w > 8  # ten calls, older ones weighted down
    assert cost.w * 0.002 <= cost.sy <= cost.w * 0.05  # in-thread times (weighted): 2 ms and up


# --- one request's rows: awaited with callbacks, not a task and a timer each -----------------


def test_a_lost_connection_cancels_the_rows_and_answers_client_gone():
    async def run():
        loop = asyncio.get_running_loop()
        rows, gone = [loop.create_future() for _ in range(3)], loop.create_future()
        waiting = asyncio.ensure_future(gather(rows, gone))
        rows[0].set_result("first")
        await asyncio.sleep(0)
        gone.set_result(None)  # the protocol's connection_lost
        with pytest.raises(ClientGone):
            await waiting
        return rows, gone

    rows, gone = asyncio.run(run())
    assert rows[0].result() == "first"
    assert rows[1].cancelled() and rows[2].cancelled()  # dropped before the model takes them
    assert not gone._callbacks  # the request's callback is gone with it


def test_the_first_row_to_fail_fails_the_request_and_cancels_the_rest():
    async def run():
        loop = asyncio.get_running_loop()
        rows, gone = [loop.create_future() for _ in range(3)], loop.create_future()
        rows[1].set_exception(DeadlineExceeded("late"))
        with pytest.raises(DeadlineExceeded):
            await gather(rows, gone)
        return rows, gone

    rows, gone = asyncio.run(run())
    assert rows[0].cancelled() and rows[2].cancelled() and not gone.done()


def test_cancelling_the_request_is_a_cancellation_even_once_the_client_is_gone():
    async def run():
        loop = asyncio.get_running_loop()
        rows, gone = [loop.create_future()], loop.create_future()
        waiting = asyncio.ensure_future(gather(rows, gone))
        await asyncio.sleep(0)
        waiting.cancel()  # a shutdown, say
        gone.set_result(None)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return rows

    assert asyncio.run(run())[0].cancelled()


def test_rows_in_a_hung_call_and_behind_it_get_504_at_the_deadline():
    """The model's watchdog, not a timer a request, answers a call that does not return."""

    async def run():
        settings = Settings(max_batch_rows=1, request_timeout_s=0.3)
        batcher = Batcher("m", SlowBackend(1.0), settings, Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        row = Row(np.full(4, 5, np.int64), np.zeros(4, np.int64))
        started = time.monotonic()
        results = await asyncio.gather(
            batcher.submit([row]), batcher.submit([row]), return_exceptions=True
        )
        elapsed = time.monotonic() - started
        await batcher.stop()
        return results, elapsed

    results, elapsed = asyncio.run(run())
    assert [type(r) for r in results] == [DeadlineExceeded, DeadlineExceeded]
    assert str(results[0]) == "model m: no result within 0.3 s"
    assert 0.3 <= elapsed < 0.6  # the deadline plus at most a tenth of it, well before 1 s


# --- a lone request: every core, on the event loop's thread ----------------------------------


class Recorded:
    """The real engine, with what each call asked for: `alone`, and the thread it ran on."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[int, bool, str]] = []  # rows, alone, thread

    @property
    def runs_alone(self) -> bool:
        return self.engine.runs_alone

    def run(self, feeds, alone=False):
        self.calls.append((len(feeds["input_ids"]), alone, threading.current_thread().name))
        return self.engine.run(feeds, alone=alone)


@pytest.fixture
def lone_engine(bundle_dir):
    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.engine import Engine, EngineOptions

    directory = bundle_dir / "sentiment"
    options = EngineOptions("CPUExecutionProvider", 1, lone_threads=2)
    return Engine(directory, load_bundle_spec(directory), options)


def serve(engine, bursts, activity=None):
    """Each burst: requests of one row each (lengths), enqueued at once and awaited. Returns
    the recorded calls, every answer's logits, the batcher and its loop's thread name."""

    async def run():
        backend = Recorded(engine)
        batcher = Batcher("m", backend, Settings(), Metrics(), {"logits": "row"}, 0, None, activity)
        batcher.start()
        answers = []
        for lengths in bursts:
            futures = [
                batcher.enqueue([Row(np.arange(5, 5 + n, dtype=np.int64), np.zeros(n, np.int64))])
                for n in lengths
            ]
            answers += [r[0].outputs["logits"] for r in [await gather(f) for f in futures]]
        await batcher.stop()
        return backend.calls, answers, batcher, threading.current_thread().name

    return asyncio.run(run())


def test_a_lone_request_runs_alone_on_the_event_loop_with_the_same_answer(lone_engine):
    """The first lone call has no measured cost and runs on the model's thread; once a call
    is measured cheap, the next runs on the loop's own."""
    calls, answers, batcher, loop_thread = serve(lone_engine, [[6], [9]])
    assert [(rows, alone) for rows, alone, _ in calls] == [(1, True), (1, True)]
    assert calls[0][2].startswith("infer-m") and calls[1][2] == loop_thread
    row = {"input_ids": np.arange(5, 11, dtype=np.int64)[None, :]}
    row |= {
        "attention_mask": np.ones((1, 6), np.int64),
        "token_type_ids": np.zeros((1, 6), np.int64),
    }
    np.testing.assert_allclose(answers[0], lone_engine.run(row)["logits"][0], atol=1e-5)
    assert batcher.metrics.lone_calls.labels("m")._value.get() == 2
    # A lone call runs on more threads than a loaded server has: its rate is not the one
    # admission estimates the queue's wait from.
    assert batcher.rows_per_s == 0 and batcher.cycle_s == 0


def test_rows_that_share_a_call_run_on_the_models_thread(lone_engine):
    calls, _, batcher, loop_thread = serve(lone_engine, [[6, 8, 7]])
    assert [(rows, alone) for rows, alone, _ in calls] == [(3, False)]
    assert calls[0][2].startswith("infer-m") and calls[0][2] != loop_thread
    assert batcher.rows_per_s > 0  # measured: a call as a loaded server makes them


def test_a_request_in_another_worker_keeps_a_lone_row_off_every_core(lone_engine):
    """The counts (the supervisor's shared array) say another worker has a request in flight
    besides this one: the row takes this worker's share of the cores, as under load."""
    calls, _, batcher, loop_thread = serve(lone_engine, [[6]], Activity([1, 1], slot=0))
    assert [(rows, alone) for rows, alone, _ in calls] == [(1, False)]
    assert calls[0][2] != loop_thread
    assert batcher.metrics.lone_calls.labels("m")._value.get() == 0
    calls, _, _, loop_thread = serve(lone_engine, [[6]], Activity([1, 0], slot=0))
    assert [(rows, alone) for rows, alone, _ in calls] == [(1, True)]  # the only one


def test_a_client_batch_takes_every_core_while_the_other_workers_are_idle(lone_engine):
    """A client batch while no other worker has a request in flight: its calls take the lone
    session (one worker's one thread served a 2,048-text request at 0.61x the rate of the same
    texts spread over both workers), on the model's thread; with a request in flight in
    another worker, they do not."""

    async def run(activity):
        backend = Recorded(lone_engine)
        batcher = Batcher("m", backend, Settings(), Metrics(), {"logits": "row"}, 0, None, activity)
        batcher.start()
        rows = [Row(np.arange(5, 5 + n, dtype=np.int64), np.zeros(n, np.int64)) for n in (6, 7, 8)]
        results = await gather(batcher.enqueue(rows, bulk=True))
        await batcher.stop()
        return backend.calls, [r.outputs["logits"] for r in results], threading.current_thread()

    calls, alone_answers, loop = asyncio.run(run(Activity([1, 0], slot=0)))
    assert [(rows, alone) for rows, alone, _ in calls] == [(3, True)]
    assert calls[0][2] != loop.name  # a batch's call is never run on the event loop
    calls, shared_answers, _ = asyncio.run(run(Activity([1, 1], slot=0)))
    assert [(rows, alone) for rows, alone, _ in calls] == [(3, False)]
    np.testing.assert_allclose(alone_answers, shared_answers, atol=1e-5)
    # Several requests here, none in the other worker (its connections all landed here): the
    # other worker's cores are idle, and this batch takes them.
    calls, _, _ = asyncio.run(run(Activity([5, 0], slot=0)))
    assert [(rows, alone) for rows, alone, _ in calls] == [(3, True)]


def test_client_batches_alone_in_a_call_run_at_a_lower_os_priority(lone_engine):
    """A call of client batches' rows only runs on a thread niced by bulk_nice: on shared cores
    the kernel runs interactive work first (a single /classify during a burst of 200 client
    batches: p50 1.14x its idle p50 with it, 2.1x without; bertserve bench clients). A call
    that holds an interactive row runs at the usual priority."""
    priorities: list[tuple[str, int]] = []

    class Niceness(Recorded):
        def run(self, feeds, alone=False):
            priorities.append(
                (
                    threading.current_thread().name,
                    os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                )
            )
            return super().run(feeds, alone)

    async def run():
        backend = Niceness(lone_engine)
        settings = Settings(bulk_nice=7)
        busy = Activity([1, 1], slot=0)  # a request in the other worker: no call runs alone
        batcher = Batcher("m", backend, settings, Metrics(), {"logits": "row"}, 0, None, busy)
        batcher.start()
        rows = [Row(np.arange(5, 5 + n, dtype=np.int64), np.zeros(n, np.int64)) for n in (6, 7)]
        await gather(batcher.enqueue(rows, bulk=True))
        await gather(batcher.enqueue(rows[:1]))
        await batcher.stop()

    base = os.getpriority(os.PRIO_PROCESS, 0)
    asyncio.run(run())
    (bulk_thread, bulk_nice), (thread, nice) = priorities
    assert bulk_thread.startswith("bulk-m") and bulk_nice == min(base + 7, 19)
    assert thread.startswith("infer-m") and nice == base


def test_without_a_lone_session_nothing_runs_on_the_event_loop(bundle_dir):
    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.engine import Engine, EngineOptions

    directory = bundle_dir / "sentiment"
    engine = Engine(directory, load_bundle_spec(directory), EngineOptions("CPUExecutionProvider"))
    calls, _, _, loop_thread = serve(engine, [[6]])
    assert [(rows, alone) for rows, alone, _ in calls] == [(1, False)]
    assert calls[0][2] != loop_thread


class Heavy:
    """A lone session whose calls take `seconds` (a long /embed, a fill-mask of 126 slots)."""

    runs_alone = True

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.threads: list[str] = []

    def run(self, feeds, alone=False):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        return {"logits": np.zeros((len(feeds["input_ids"]), 2), np.float32)}


def test_heavy_lone_calls_leave_the_event_loop_free():
    """The review's finding: back to back heavy lone requests ran on the loop's thread and
    held /health/live for up to 624 ms. A call measured (or not yet measured) to cost more
    than LoneCost.INLINE_S runs on the model's thread: the loop's lag stays small."""

    async def run():
        backend = Heavy(0.08)
        batcher = Batcher("m", backend, Settings(), Metrics(), {"logits": "row"}, 0, None)
        batcher.start()
        lags: list[float] = []
        done = asyncio.Event()

        async def probe():
            while not done.is_set():
                started = time.perf_counter()
                await asyncio.sleep(0.002)
                lags.append(time.perf_counter() - started - 0.002)

        prober = asyncio.create_task(probe())
        for n in (6, 9, 12, 7):
            row = Row(np.arange(5, 5 + n, dtype=np.int64), np.zeros(n, np.int64))
            await gather(batcher.enqueue([row]))
        done.set()
        await prober
        await batcher.stop()
        return backend.threads, lags, threading.current_thread().name

    threads, lags, loop_thread = asyncio.run(run())
    assert len(threads) == 4 and loop_thread not in threads
    assert max(lags) < 0.05, max(lags)


def test_lone_cost_keeps_more_mask_slots_than_measured_off_the_loop():
    cost = LoneCost()
    small = {"input_ids": np.zeros((1, 16), np.int64), "mask_positions": np.zeros((1, 1))}
    assert not cost.inline(small)  # nothing measured
    cost.observe(small, 0.002)
    assert cost.inline(small)
    many = {"input_ids": np.zeros((1, 16), np.int64), "mask_positions": np.zeros((1, 12))}
    assert not cost.inline(many)  # its slots' cost is not measured
    long = {"input_ids": np.zeros((1, 512), np.int64)}
    assert not cost.inline(long)  # 512 x 125 us: over INLINE_S
    cost.observe(many, 0.5)  # measured heavy: the rate errs high, and decays
    assert not cost.inline(small)
    for _ in range(200):
        cost.observe(small, 0.002)
    assert cost.inline(small)
    assert not cost.inline(many)  # its slots were measured, but never within INLINE_S


def test_the_cost_of_a_token_in_large_calls_follows_the_row_length():
    """Before a spread of sizes is measured, a token is priced by the length of its row:
    interpolated between the padded lengths measured (attention makes long rows' tokens
    dearer), the nearest beyond them; small calls, whose fixed cost weighs, do not count."""
    cost = CallCost()
    assert cost.large_seconds([64]) == 0.0
    short, long_ = np.zeros((32, 32), np.int64), np.zeros((2, 512), np.int64)
    cost.note_large({"input_ids": short}, 32 * 32 * 1e-4)
    cost.note_large({"input_ids": long_}, 2 * 512 * 3e-4)
    cost.note_large({"input_ids": np.zeros((2, 128), np.int64)}, 1.0)  # small: not counted
    assert cost.large_seconds([32]) == pytest.approx(32 * 1e-4)
    assert cost.large_seconds([512]) == pytest.approx(512 * 3e-4)
    assert cost.large_seconds([272]) == pytest.approx(272 * 2e-4)
    assert cost.large_seconds([8, 900]) == pytest.approx(8 * 1e-4 + 900 * 3e-4)  # the nearest
