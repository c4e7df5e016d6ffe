"""/classify: sequence classification, as the transformers text-classification pipeline."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.schemas import WHOLE, Params, Request, Text
from bertserve.runtime.tasks.chunks import (
    MEAN_OVERLAP_TOKENS,
    Groups,
    LongInput,
    chunk_rows,
    long_mode,
    room,
    weighted_mean,
)
from bertserve.runtime.tasks.common import Task, TaskContext, row, sigmoid, softmax


class ClassifyParams(Params):
    top_k: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        1, description="labels per input; null for all"
    )
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = None
    truncation: bool = False
    long_input: LongInput | None = Field(
        None,
        description="a text longer than the model's window: error (413), truncate, or chunk "
        "(the mean of its chunks' logits, weighted by their pieces, goes through "
        "function_to_apply); left out: truncate if `truncation`, else the service's "
        "BERTSERVE_LONG_INPUT",
    )


class ClassifyRequest(Request):
    inputs: Text | Annotated[list[Text], Field(min_length=1)]
    parameters: ClassifyParams = ClassifyParams()


class LabelScore(BaseModel):
    label: str
    score: float


def preprocess(ctx: TaskContext, texts: list[str], mode: LongInput) -> tuple[list[Row], Groups]:
    """A row a text; with `mode` "chunk" a row a chunk of an over-long one (chunks of the
    window, side by side: MEAN_OVERLAP_TOKENS)."""
    if mode != "chunk":
        rows = [row(ctx.encode(ctx.check_text(t), truncate=mode == "truncate")) for t in texts]
        return rows, Groups.one_each(len(rows))
    size = room(ctx, 0)
    overlap = MEAN_OVERLAP_TOKENS
    return chunk_rows(ctx, texts, size, overlap, lambda t: ctx.encode(t, truncate=True))


def postprocess(
    ctx: TaskContext,
    results: list[RowResult],
    top_k: int | None,
    function_to_apply: str | None,
    groups: Groups | None = None,
) -> list[list[dict]]:
    labels = ctx.spec.labels or []
    if function_to_apply is None:
        function_to_apply = "softmax" if len(labels) > 1 else "sigmoid"
    groups = groups or Groups.one_each(len(results))
    out = []
    for span, weights in zip(groups.spans, groups.weights, strict=True):
        logits = weighted_mean([results[i].outputs["logits"] for i in span], weights)
        if function_to_apply == "softmax":
            scores = softmax(logits)
        elif function_to_apply == "sigmoid":
            scores = sigmoid(logits)
        else:
            scores = logits
        order = np.argsort(-scores, kind="stable")[: top_k or len(labels)]
        out.append([{"label": labels[i], "score": float(scores[i])} for i in order])
    return out


class Classify(Task):
    path = "/classify"
    capability = "classify"
    reads = ("logits",)
    request = ClassifyRequest
    response = list[LabelScore] | list[list[LabelScore]]
    summary = "Label each text (sentiment with the shipped models)"
    example: ClassVar[dict[str, Any]] = {"inputs": "a charming and often affecting journey"}
    # huggingface_hub's InferenceClient.text_classification takes element 0 of the answer, as
    # the Hugging Face Inference API nests one text's labels ([[...]]); the pipeline's shape, a
    # flat list, would give it one label where top_k asked for more.
    nests_single_for = (b"hf_hub/",)

    def prepare(
        self, ctx: TaskContext, items: list[Any], request: ClassifyRequest
    ) -> tuple[list[Row], Groups]:
        p = request.parameters
        return preprocess(ctx, items, long_mode(ctx, p.long_input, p.truncation or None))

    def finish(
        self, ctx: TaskContext, prepared: Groups, results: list[RowResult], request: ClassifyRequest
    ) -> list[Any]:
        p = request.parameters
        return postprocess(ctx, results, p.top_k, p.function_to_apply, prepared)


TASK = Classify()
