"""Fair shares between tenants in one model's queue (runtime.fairness): calls formed from
several tenants' rows serve each in proportion to its weight, in tokens, whatever each sent;
a tenant's flood meets its own share of the admission bounds while the others are admitted;
alone, a tenant has the whole queue as before."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import numpy as np

from bertserve.runtime.batching import Batcher, Row
from tests.runtime.test_batching import Metrics, Settings


def row(length: int) -> Row:
    return Row(np.full(length, 5, np.int64), np.zeros(length, np.int64))


def served(sends, calls: int, settings: Settings | None = None, metrics=None):
    """Enqueue each (tenant, weight, rows, length) in order, then form `calls` calls: the
    tenants of the rows served, in order."""

    async def run():
        batcher = Batcher(
            "m", None, settings or Settings(max_batch_rows=4), metrics or Metrics(), {}, 0, None
        )
        for tenant, weight, count, length in sends:
            batcher.enqueue([row(length) for _ in range(count)], tenant=tenant, weight=weight)
        order = []
        for _ in range(calls):
            order += [item.request.tenant for item in batcher._select()]
        return order

    return asyncio.run(run())


def test_two_tenants_of_equal_weight_share_the_calls_whatever_each_sent():
    """A queued 100 rows before B sent 20: from B's first row on, they alternate."""
    order = served([("a", 1.0, 100, 8), ("b", 1.0, 20, 8)], calls=10)
    assert Counter(order) == {"a": 20, "b": 20}
    assert Counter(order[:8]) == {"a": 4, "b": 4}


def test_weights_split_the_rows_served_in_their_ratio():
    order = served([("a", 3.0, 100, 8), ("b", 1.0, 100, 8)], calls=20)
    assert Counter(order) == {"a": 60, "b": 20}


def test_the_share_is_of_tokens_so_longer_rows_get_fewer():
    """B's rows are twice as long as A's: at equal weight A is served twice B's rows."""
    order = served([("a", 1.0, 100, 8), ("b", 1.0, 100, 16)], calls=12)
    counts = Counter(order)
    assert abs(counts["a"] * 8 - counts["b"] * 16) <= 4 * 16  # within one call's tokens


def test_the_rows_served_are_counted_by_tenant():
    metrics = Metrics()
    served([("a", 1.0, 6, 8), ("b", 1.0, 2, 8)], calls=2, metrics=metrics)
    assert metrics.value("tenant_rows", model="m", tenant="a") == 6
    assert metrics.value("tenant_rows", model="m", tenant="b") == 2


def test_a_flood_meets_its_own_share_of_the_queue_and_the_others_are_admitted():
    """max_queue_rows 20: A alone queues all 20; then B is admitted up to its half, while A
    is refused until it is back within its own half."""

    async def run():
        settings = dataclasses.replace(Settings(), max_queue_rows=20, max_queue_wait_ms=0)
        batcher = Batcher("m", None, settings, Metrics(), {}, 0, None)
        for _ in range(20):
            assert batcher.refusal(1, tenant="a") is None
            batcher.enqueue([row(8)], tenant="a")
        assert "20 sequences queued (the limit)" in batcher.refusal(1, tenant="a")
        for _ in range(10):
            assert batcher.refusal(1, tenant="b") is None
            batcher.enqueue([row(8)], tenant="b")
        refused = batcher.refusal(1, tenant="b")
        assert refused is not None and "for this tenant (its share)" in refused
        assert batcher.refusal(1, tenant="a") is not None
        assert batcher.refusal(1, tenant="c") is None  # a third tenant has its third
        # A weight of 3 beside A's and B's 1 each is three fifths of the bound: 12 of 20.
        assert batcher.refusal(12, tenant="d", weight=3.0) is None
        assert batcher.refusal(13, tenant="d", weight=3.0) is not None

    asyncio.run(run())


def test_a_floods_time_in_the_queue_is_its_own():
    """The wait bound (max_queue_wait_ms) of a tenant counts its rows at its share of the
    rate: A with 400 ms of rows alone is refused past 500 ms beside B, while B is admitted."""

    async def run():
        batcher = Batcher("m", None, Settings(), Metrics(), {}, 0, None)
        batcher.rows_per_s = 100.0
        batcher.enqueue([row(8) for _ in range(40)], tenant="a")  # 400 ms at the whole rate
        assert batcher.refusal(1, tenant="a") is None
        batcher.enqueue([row(8)], tenant="b")
        assert "ms of work queued for this tenant" in batcher.refusal(1, tenant="a")  # 800 ms
        assert batcher.refusal(1, tenant="b") is None

    asyncio.run(run())


def test_client_batches_share_their_lane_bound_the_same_way():
    async def run():
        settings = dataclasses.replace(Settings(), max_bulk_queue_rows=100)
        batcher = Batcher("m", None, settings, Metrics(), {}, 0, None)
        batcher.enqueue([row(8) for _ in range(100)], bulk=True, tenant="indexer")
        assert batcher.refusal(2, bulk=True, tenant="indexer") is not None
        assert batcher.refusal(50, bulk=True, tenant="search") is None
        assert batcher.refusal(51, bulk=True, tenant="search") is not None

    asyncio.run(run())
