"""The warm-up: representative shapes through every model before the service says ready, and
the probe that lets /nsp rows skip the MLM head where the graph runs them alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np

from bertserve.runtime.batching import without_slots
from bertserve.runtime.engine import Engine, warmup_feeds
from bertserve.service.models import Model
from bertserve.service.settings import Settings

log = logging.getLogger("bertserve.warmup")


def warm_up(models: Iterable[Model], settings: Settings) -> None:
    """Run representative shapes through every model before saying ready: ORT allocates
    and picks kernels on first use of a shape."""
    for model in models:
        started = time.monotonic()
        shapes = warmup_feeds(model.spec, settings.max_batch_rows, settings.max_batch_tokens)
        first = model.engine.run(shapes[0])
        for feeds in shapes[1:]:
            model.engine.run(feeds)
        heads = tuple(model.spec.heads)  # head graphs run only when asked: warm them too
        for feeds in shapes if heads else ():
            model.engine.run(feeds, extra=heads)
        if isinstance(model.engine, Engine) and model.engine.runs_alone:
            for feeds in (shapes[0], shapes[-1]):  # the lone session's: one row, any length
                model.engine.run(feeds, alone=True)
                if heads:
                    model.engine.run(feeds, alone=True, extra=heads)
                # Timed once warm: whether a lone call of this size may run on the event loop.
                call = time.perf_counter()
                model.engine.run(feeds, alone=True)
                seconds = time.perf_counter() - call
                model.batcher.lone_cost.observe(feeds, seconds)
        if model.batcher.positions is not None:
            probe_slots(model, shapes[0], first)
        log.info(
            "warmed %s in %.2f s%s",
            model.name,
            time.monotonic() - started,
            "; rows without mask slots (/nsp) skip the MLM head"
            if model.batcher.positions == 0
            else "",
        )


def probe_slots(model: Model, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
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
