"""/classify: sequence classification, as the transformers text-classification pipeline."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.schemas import WHOLE, Params, Request, Text
from bertserve.runtime.tasks.common import Task, TaskContext, row, sigmoid, softmax


class ClassifyParams(Params):
    top_k: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        1, description="labels per input; null for all"
    )
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = None
    truncation: bool = False


class ClassifyRequest(Request):
    inputs: Text | Annotated[list[Text], Field(min_length=1)]
    parameters: ClassifyParams = ClassifyParams()


class LabelScore(BaseModel):
    label: str
    score: float


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
    ) -> tuple[list[Row], None]:
        return preprocess(ctx, items, request.parameters.truncation), None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: ClassifyRequest
    ) -> list[Any]:
        p = request.parameters
        return postprocess(ctx, results, p.top_k, p.function_to_apply)


TASK = Classify()
