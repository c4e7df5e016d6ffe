"""The batching policy (`Batcher._select`) on its own: the oldest row always goes first, the
rows closest to it in length join it, the row cap and the token budget (rows x longest) hold,
and cancelled or expired rows are dropped before they cost compute."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from service.batching import Batcher, Row, _Item, _Request
from service.errors import DeadlineExceeded, Overloaded
from service.metrics import Metrics
from service.settings import Settings


def select(lengths, *, rows=4, tokens=1000, cancelled=(), expired=()):
    """Queue rows of the given lengths (oldest first), pick one batch; returns the lengths of
    the batch in pick order, the lengths left queued, and the items."""

    async def run():
        loop = asyncio.get_running_loop()
        settings = Settings(max_batch_rows=rows, max_batch_tokens=tokens)
        batcher = Batcher("m", None, settings, Metrics(), {}, 0, False)
        now = time.monotonic()
        items = []
        for i, n in enumerate(lengths):
            row = Row(np.full(n, 5, np.int64), np.zeros(n, np.int64))
            deadline = now - 1 if i in expired else now + 60
            item = _Item(row, loop.create_future(), deadline, _Request(), now + i * 1e-3)
            if i in cancelled:
                item.future.cancel()
            items.append(item)
        batcher._items = list(items)
        batch = batcher._select()
        return [len(i.row) for i in batch], [len(i.row) for i in batcher._items], items

    return asyncio.run(run())


@pytest.fixture(autouse=True)
def bundles_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTSERVE_BUNDLES", str(tmp_path))


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
        batcher = Batcher("m", SlowBackend(0.02), settings, Metrics(), {"logits": "row"}, 0, False)
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
