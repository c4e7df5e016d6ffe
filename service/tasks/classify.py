"""/classify: sequence classification, as the transformers text-classification pipeline."""

from __future__ import annotations

import numpy as np

from service.batching import Row, RowResult
from service.tasks.common import TaskContext, row, sigmoid, softmax


def preprocess(ctx: TaskContext, texts: list[str], truncate: bool) -> list[Row]:
    return [row(ctx.encode(ctx.check_text(t), truncate=truncate)) for t in texts]


def postprocess(
    ctx: TaskContext, results: list[RowResult], top_k: int | None, function_to_apply: str | None
) -> list[list[dict]]:
    labels = ctx.spec.labels or []
    if function_to_apply is None:
        function_to_apply = "softmax" if len(labels) > 1 else "sigmoid"
    out = []
    for result in results:
        logits = result.outputs["logits"].astype(np.float64)
        if function_to_apply == "softmax":
            scores = softmax(logits)
        elif function_to_apply == "sigmoid":
            scores = sigmoid(logits)
        else:
            scores = logits
        order = np.argsort(-scores, kind="stable")[: top_k or len(labels)]
        out.append([{"label": labels[i], "score": float(scores[i])} for i in order])
    return out
