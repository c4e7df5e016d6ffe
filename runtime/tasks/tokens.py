"""Per-token vectors: `/embed_all` in text-embeddings-inference's schema, on embedding bundles.

An input's answer is the encoder's last hidden state at each of its positions, special tokens
included, unpooled and unnormalised, as TEI's /embed_all answers it: the raw material of
late-interaction scoring and of a client's own pooling. The graph computes these token states
only for a batch that asks for them (`runtime.capabilities.ON_DEMAND`). An answer grows with its
inputs' lengths (a vector a token, sized as /embed sizes its vectors: 5.8 kB a token of a
384-wide model), so its size is checked against the answer limit once the inputs are tokenised,
before the model runs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import Request
from bertserve.runtime.tasks.chunks import long_mode
from bertserve.runtime.tasks.common import Task, TaskContext
from bertserve.runtime.tasks.embed import (
    PromptName,
    Texts,
    Truncate,
    TruncationDirection,
    answer_bytes,
    text_rows,
)

TOKEN_STATES = "token_embeddings"


class EmbedAllRequest(Request):
    inputs: Texts
    truncate: Truncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None


class EmbedAll(Task):
    path = "/embed_all"
    capability = "embed"
    reads = (TOKEN_STATES,)
    request = EmbedAllRequest
    response = list[list[list[float]]]
    summary = "Every token's last hidden state (text-embeddings-inference's /embed_all)"
    example: ClassVar[dict[str, Any]] = {"inputs": "A man is eating food."}

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        if TOKEN_STATES not in ctx.spec.outputs:
            raise InvalidInput(
                f"model {ctx.spec.name}'s graph was exported without its token states: export "
                "it again with this version (bertserve export --task embed)"
            )
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: EmbedAllRequest
    ) -> tuple[list[Row], None]:
        mode = long_mode(ctx, None, request.truncate)
        if mode == "chunk":
            mode = "error"  # a token's state belongs to one window: no chunks to join
        rows, _ = text_rows(ctx, items, request.prompt_name, mode, request.truncation_direction)
        tokens = sum(len(r) for r in rows)
        size = answer_bytes(ctx, tokens, None, base64=False)
        if size > ctx.max_response_bytes:
            width = ctx.spec.architecture.hidden_size
            raise TooLarge(
                f"{tokens:,} tokens of {width} components may take {size:,} bytes; the answer "
                f"limit is {ctx.max_response_bytes:,} (BERTSERVE_MAX_RESPONSE_BYTES). Send fewer "
                "or shorter inputs a request"
            )
        return [Row(r.input_ids, r.token_type_ids, wants=(TOKEN_STATES,)) for r in rows], None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: Any
    ) -> list[Any]:
        return [r.outputs[TOKEN_STATES].astype(np.float32) for r in results]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers  # a list an input, also for one input (TEI)


EMBED_ALL = EmbedAll()
