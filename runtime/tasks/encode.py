"""Several heads from one pass: `POST /encode` answers a text's dense vector and its sparse
(SPLADE) weights together, from one encoder pass, on a bundle that carries both heads over one
encoder (`bertserve export --task embed,sparse`: bundle.json "heads").

The schema is FlagEmbedding's `BGEM3FlagModel.encode`, the published call that returns several
heads of one model at once: `return_dense` and `return_sparse` ask for each (dense by default),
and the answer's `dense_vecs` and `lexical_weights` are as it returns them (a vector a text; a
`{"token id": weight}` object a text, ids in increasing order; for one bare text, the vector
and the object themselves), with `colbert_vecs` null: a multi-vector head beside these is not
served (`return_colbert_vecs: true` is a 422). The texts are `inputs` (TEI's name; FlagEmbedding's
argument is `sentences`). The rest is /embed's and /embed_sparse's: `normalize`, `dimensions`,
`truncate`, `truncation_direction`, `prompt_name`, `top_k`, `min_weight`.

Each text is one row (long inputs are cut or refused; chunking, whose dense and sparse answers
combine differently, is /embed's and /embed_sparse's). A row asks for the sparse head's output
only when the request does (`wanted`), so a dense-only request costs what /embed costs; rows of
/embed, /embed_sparse and /encode share batches, and a batch runs the encoder once and the
sparse head only if one of its rows asks for it (runtime.engine).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import WHOLE, Request
from bertserve.runtime.tasks.common import LongInput, Task, TaskContext, usage
from bertserve.runtime.tasks.embed import (
    Dimensions,
    PromptName,
    Texts,
    Truncate,
    TruncationDirection,
    answer_bytes,
    check_dimensions,
    embeddings,
    text_rows,
)
from bertserve.runtime.tasks.sparse import side

DENSE, SPARSE = "embeddings", "sparse_embeddings"
# The most bytes one lexical weight takes as JSON: "30521":1.2345678e-05,
WEIGHT_BYTES = 26


class EncodeRequest(Request):
    inputs: Texts
    return_dense: bool = Field(True, description="answer each text's dense vector")
    return_sparse: bool = Field(
        False, description="answer each text's sparse (SPLADE) weights, from the same pass"
    )
    normalize: bool = Field(True, description="dense vectors of unit length")
    dimensions: Dimensions = None
    truncate: Truncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    top_k: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="keep each sparse vector's k largest weights"
    )
    min_weight: float = Field(0.0, ge=0.0, description="drop sparse weights below this")
    return_colbert_vecs: bool = Field(
        False, description="BGE-M3's multi-vector head: not served beside these (true is a 422)"
    )


class EncodeResponse(BaseModel):
    dense_vecs: list[list[float]] | list[float] | None = Field(
        description="a vector a text (one bare text: its vector), with return_dense (else null)"
    )
    lexical_weights: list[dict[str, float]] | dict[str, float] | None = Field(
        description='with return_sparse (else null): a {"token id": weight} object a text '
        "(one bare text: its object), its non-zero weights in increasing id order"
    )
    colbert_vecs: None = Field(None, description="always null: no multi-vector head is served")
    model: str
    usage: dict[str, int]


def weights(vector: np.ndarray, top_k: int | None, min_weight: float) -> dict[str, float]:
    """A sparse vector as FlagEmbedding's lexical weights: {str(id): weight}, non-zero (at
    least `min_weight`; the `top_k` largest), ids in increasing order."""
    keep = np.flatnonzero((vector > 0) & (vector >= min_weight))
    if top_k is not None and len(keep) > top_k:
        keep = np.sort(keep[np.argpartition(-vector[keep], top_k - 1)[:top_k]])
    return dict(zip(map(str, keep.tolist()), vector[keep].tolist(), strict=True))


class Encode(Task):
    path = "/encode"
    capability = "embed"
    reads = (DENSE,)
    request = EncodeRequest
    response = EncodeResponse
    summary = "Dense and sparse vectors from one pass (FlagEmbedding's BGEM3FlagModel.encode)"
    example: ClassVar[dict[str, Any]] = {
        "inputs": "Where was Aristotle born?",
        "return_sparse": True,
    }

    def needs(self, request: EncodeRequest) -> tuple[str, ...]:
        return ("sparse",) if request.return_sparse else ()

    def wanted(self, request: EncodeRequest) -> tuple[str, ...]:
        return (DENSE, SPARSE) if request.return_sparse else (DENSE,)

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        if request.return_colbert_vecs:
            raise InvalidInput(
                "return_colbert_vecs: no multi-vector head is served beside the dense and sparse "
                "ones; a ColBERT bundle answers POST /v1/multi-vector"
            )
        if not (request.return_dense or request.return_sparse):
            raise InvalidInput("return_dense and return_sparse are both false: ask for one")
        check_dimensions(ctx, request.dimensions)
        # The answer's size, bounded before any work: the dense vectors', and the sparse
        # weights' where top_k bounds them (without it, the answer's guard refuses it after).
        size = answer_bytes(ctx, len(items), request.dimensions, False) * request.return_dense
        if request.return_sparse and request.top_k is not None:
            most = min(request.top_k, ctx.spec.tokenizer.vocab_size)
            size += len(items) * (most * WEIGHT_BYTES + 8)
        if size > limits.max_response_bytes:
            raise TooLarge(
                f"the answer for {len(items):,} texts may take {size:,} bytes; the answer limit "
                f"is {limits.max_response_bytes:,} (BERTSERVE_MAX_RESPONSE_BYTES). Send fewer "
                "inputs a request, a smaller top_k, or fewer dimensions"
            )
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: EncodeRequest
    ) -> tuple[list[Row], None]:
        sparse = ctx.spec.sparse
        if request.return_sparse and sparse is not None and sparse.static_side == side(ctx, None):
            raise InvalidInput(
                f"model {ctx.spec.name} weights {sparse.static_side} texts without the encoder: "
                "there is no pass to share; ask POST /embed_sparse for them"
            )
        mode: LongInput = "truncate" if ctx.truncating(request.truncate) else "error"
        rows, _ = text_rows(ctx, items, request.prompt_name, mode, request.truncation_direction)
        return rows, None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: EncodeRequest
    ) -> list[Any]:
        dense = (
            embeddings(results, request.normalize, request.dimensions)
            if request.return_dense
            else [None] * len(results)
        )
        lexical = [
            weights(r.outputs[SPARSE].astype(np.float32), request.top_k, request.min_weight)
            if request.return_sparse
            else None
            for r in results
        ]
        return list(zip(dense, lexical, strict=True))

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        dense = [d for d, _ in answers] if request.return_dense else None
        lexical = [s for _, s in answers] if request.return_sparse else None
        if single:  # FlagEmbedding answers one text's vector and object themselves
            dense = dense[0] if dense is not None else None
            lexical = lexical[0] if lexical is not None else None
        return {
            "dense_vecs": dense,
            "lexical_weights": lexical,
            "colbert_vecs": None,
            "model": model,
            "usage": usage(rows),
        }


ENCODE = Encode()
