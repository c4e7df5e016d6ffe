"""The raw ceiling: a bundle's ONNX model run in this process on the same token sequences the
load generator sends, with the best batching we can give it and no HTTP, no queue, no JSON.

    bertserve bench ceiling --bundle bundles/sst2-distilled-2x192 \
        --bodies runs/bench/inputs/classify.jsonl

Sequences are tokenised once up front (tokenising is the server's job, not the model's), sorted
by length and cut into batches of each candidate size; the best size's sequences/s is the
ceiling. Also reports a single raw inference (batch 1, median over the inputs): the floor under
any server's latency at concurrency 1. The session is built by the service's own Engine, so
threads and providers are the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bertserve.runtime.batching import pad_rows
from bertserve.runtime.bundle import load_bundle_spec
from bertserve.runtime.engine import ENGINES, OPENVINO_PRECISIONS, Engine
from bertserve.runtime.tasks import classify
from bertserve.runtime.tasks.common import TaskContext
from bertserve.service.settings import Settings


def load(
    bundle: Path, threads: int = 0, engine: str = "bundle", openvino_precision: str = "bundle"
) -> tuple[Engine, TaskContext]:
    """The bundle on the service's Engine with every core (the model's best on this machine);
    `engine`: Settings' engine and openvino_precision, if given."""
    spec = load_bundle_spec(bundle)
    settings = Settings(
        bundles=bundle.parent,
        intra_op_threads=threads or os.cpu_count() or 1,
        engine=engine,
        openvino_precision=openvino_precision,
    )
    return Engine(bundle, spec, settings.engine_options()), TaskContext.load(bundle, spec, 100_000)


def text_rows(ctx: TaskContext, texts: list[str]) -> list:
    """The texts tokenised as /classify tokenises them, cut at the model's window."""
    return classify.preprocess(ctx, texts, "truncate")[0]


def classify_rows(ctx: TaskContext, bodies: Path) -> list:
    texts = [json.loads(line)["inputs"] for line in bodies.read_text().splitlines() if line]
    return text_rows(ctx, texts)


def ceiling(
    engine: Engine,
    rows: list,
    pad_id: int,
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64),
    seconds: float = 3.0,
    sort: bool = True,
) -> dict:
    """Sequences/s at each batch size over length-sorted rows; the best is the ceiling.
    `sort=False`: the rows in arrival order, cut into the same sizes, as a server's batches
    of whatever arrived together are padded to their longest."""
    ordered = sorted(rows, key=len) if sort else list(rows)
    lengths = [len(r) for r in rows]
    per_size, cpu_us = {}, {}
    for size in batch_sizes:
        batches = [
            pad_rows(ordered[i : i + size], pad_id, None)[0] for i in range(0, len(ordered), size)
        ]
        engine.run(batches[0])  # warm this shape
        done, started, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds:
            for feeds in batches:
                engine.run(feeds)
                done += len(feeds["input_ids"])
        per_size[size] = done / (time.perf_counter() - started)
        cpu_us[size] = 1e6 * (time.process_time() - cpu) / done  # every thread of this process
    best = max(per_size, key=lambda s: per_size[s])
    return {
        "sequences_per_s": per_size[best],
        "best_batch": best,
        "per_batch_size": per_size,
        "cpu_us_per_sequence": cpu_us[best],
        "mean_tokens": statistics.fmean(lengths),
    }


def single_feeds(rows: list, pad_id: int, count: int) -> list[dict[str, np.ndarray]]:
    """One batch-1 call's inputs for each of the first `count` rows (repeated if fewer)."""
    return [pad_rows([r], pad_id, None)[0] for r in (rows * (1 + count // len(rows)))[:count]]


def call_ms(engine: Engine, feeds: list, gap_s: float = 0.0, spin: bool = False) -> float:
    """Median ms of one call each over `feeds`; with `gap_s`, each call after that long idle,
    slept or spun on the clock (`bench.experiments.idle_gap`), the idle time not counted."""
    times = []
    for f in feeds:
        if gap_s:
            if spin:
                until = time.perf_counter() + gap_s
                while time.perf_counter() < until:
                    pass
            else:
                time.sleep(gap_s)
        started = time.perf_counter()
        engine.run(f)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def single_latency_ms(engine: Engine, rows: list, pad_id: int, count: int = 300) -> float:
    """Median time of one batch-1 model call, back to back, over the first `count` inputs."""
    return call_ms(engine, single_feeds(rows, pad_id, count))


def measure(
    bundle: Path,
    bodies: Path,
    seconds: float = 3.0,
    engine: str = "bundle",
    openvino_precision: str = "bundle",
) -> dict:
    """The two ceilings (length-sorted batches, and the same sizes unsorted as a server forms
    them) and the batch-1 latency of `bundle` on the /classify bodies in `bodies`."""
    model, ctx = load(bundle, 0, engine, openvino_precision)
    rows = classify_rows(ctx, bodies)
    pad = ctx.spec.tokenizer.pad_id
    result = ceiling(model, rows, pad, seconds=seconds)
    unsorted = ceiling(model, rows, pad, seconds=seconds, sort=False)
    result["unsorted"] = {k: unsorted[k] for k in ("sequences_per_s", "best_batch")}
    result["single_ms"] = single_latency_ms(model, rows, pad)
    result["engine"] = model.engine_name
    result["engine_choice"] = model.engine_choice
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/sst2-distilled-2x192"))
    parser.add_argument("--bodies", type=Path, default=Path("runs/bench/inputs/classify.jsonl"))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--engine", default="bundle", choices=ENGINES)
    parser.add_argument("--openvino-precision", default="bundle", choices=OPENVINO_PRECISIONS)
    args = parser.parse_args()
    result = measure(args.bundle, args.bodies, args.seconds, args.engine, args.openvino_precision)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
