"""/nsp: does text_pair follow text? The pre-training NSP head (class 0 = is next)."""

from __future__ import annotations

import numpy as np

from service.batching import Row, RowResult
from service.tasks.common import TaskContext, row, softmax


def preprocess(ctx: TaskContext, pairs: list[tuple[str, str]], truncate: bool) -> list[Row]:
    rows = []
    for text, pair in pairs:
        enc = ctx.encode(ctx.check_text(text, "text"), ctx.check_text(pair, "text_pair"), truncate)
        rows.append(row(enc, np.zeros(1, dtype=np.int64)))  # one (ignored) fill-mask slot
    return rows


def postprocess(results: list[RowResult]) -> list[dict]:
    out = []
    for result in results:
        p_next = float(softmax(result.outputs["nsp_logits"].astype(np.float64))[0])
        out.append({"is_next": p_next >= 0.5, "score": p_next})
    return out
