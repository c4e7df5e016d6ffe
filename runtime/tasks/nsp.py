"""/nsp: does text_pair follow text? The pre-training NSP head (class 0 = is next)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.schemas import STRICT, Params, Request, Text
from bertserve.runtime.tasks.common import Task, TaskContext, row, softmax


class NspInput(BaseModel):
    model_config = STRICT
    text: Text
    text_pair: Text


class NspParams(Params):
    truncation: bool = False


class NspRequest(Request):
    inputs: NspInput | Annotated[list[NspInput], Field(min_length=1)]
    parameters: NspParams = NspParams()


class NspResult(BaseModel):
    is_next: bool
    score: float = Field(description="probability that text_pair follows text")


def preprocess(ctx: TaskContext, pairs: list[tuple[str, str]], truncate: bool) -> list[Row]:
    rows = []
    for text, pair in pairs:
        enc = ctx.encode(ctx.check_text(text, "text"), ctx.check_text(pair, "text_pair"), truncate)
        rows.append(row(enc))  # no fill-mask slots: the MLM head need not run for it
    return rows


def postprocess(results: list[RowResult]) -> list[dict]:
    out = []
    for result in results:
        p_next = float(softmax(result.outputs["nsp_logits"].astype(np.float64))[0])
        out.append({"is_next": p_next >= 0.5, "score": p_next})
    return out


class Nsp(Task):
    path = "/nsp"
    capability = "nsp"
    reads = ("nsp_logits",)
    request = NspRequest
    response = NspResult | list[NspResult]
    summary = "Does text_pair follow text? (next-sentence prediction)"
    example: ClassVar[dict[str, Any]] = {
        "inputs": {"text": "I went to the bakery.", "text_pair": "I bought fresh bread."}
    }

    def prepare(
        self, ctx: TaskContext, items: list[NspInput], request: NspRequest
    ) -> tuple[list[Row], None]:
        pairs = [(i.text, i.text_pair) for i in items]
        return preprocess(ctx, pairs, request.parameters.truncation), None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: NspRequest
    ) -> list[Any]:
        return postprocess(results)


TASK = Nsp()
