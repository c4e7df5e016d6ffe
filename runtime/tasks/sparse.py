"""Sparse (SPLADE) embeddings: `/embed_sparse` in text-embeddings-inference's schema, on bundles
exported with the `sparse` task.

The graph computes the MLM head's logits at every position and pools them as
sentence-transformers' `SpladePooling` does (log(1 + ReLU(logits)), the max over the text's
tokens: export/graph.py): one weight a vocabulary entry, most of them zero. Here the non-zero
ones become `{"index", "value"}` pairs, in index order, as TEI answers them; a request may keep
only its `top_k` largest or those of at least `min_weight`, and ask for each entry's vocabulary
token.

An inference-free model (sentence-transformers' `Router` with a `SparseStaticEmbedding` side,
bundle.json "sparse.static_side") weights the texts of that side by a learned weight a token,
each token present counted once, without the encoder: such a request costs a tokenising and no
model call. `input_type` says which side a text is ("query" or "document", as
`SparseEncoder.encode_query` / `encode_document`); left out, the model's default route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import WHOLE, Request
from bertserve.runtime.tasks.chunks import Groups, long_mode
from bertserve.runtime.tasks.common import Task, TaskContext, tokenize
from bertserve.runtime.tasks.embed import (
    LongInputField,
    PromptName,
    Texts,
    Truncate,
    TruncationDirection,
    prompted,
    text_rows,
)

Side = Literal["query", "document"]
# The most bytes one entry takes as JSON: {"index":30521,"value":1.2345678e-05}, (and with
# return_tokens "token" with its text, counted apart).
ENTRY_BYTES = 44


class SparseRequest(Request):
    inputs: Texts
    truncate: Truncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    long_input: LongInputField = None
    input_type: Side | None = Field(
        None,
        description="the texts are queries or documents (SparseEncoder.encode_query / "
        "encode_document): the side of an inference-free model, and the prompt of that name "
        "where the bundle declares one; left out: the model's default side and prompt",
    )
    top_k: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="keep each vector's k largest weights (the rest are dropped)"
    )
    min_weight: float = Field(
        0.0, ge=0.0, description="drop weights below this (0: keep every non-zero weight)"
    )
    return_tokens: bool = Field(False, description="each entry's vocabulary token beside it")


class SparseValue(BaseModel):
    index: int = Field(description="the vocabulary id (the sparse vector's dimension)")
    value: float
    token: str | None = Field(None, description="the vocabulary entry, with return_tokens")


@dataclass
class SparsePlan:
    """What finish needs: which rows are whose (encoder side), or the vectors already made
    (the static side, which needs no model call)."""

    groups: Groups | None
    static: list[np.ndarray] | None = None


def side(ctx: TaskContext, asked: Side | None) -> Side:
    """The side a request's texts are: as asked, else the model's default route."""
    sparse = ctx.spec.sparse
    return asked or (sparse.default_side if sparse is not None else "document")


def prompt_for(ctx: TaskContext, request: SparseRequest) -> str | None:
    """The prompt name a request's texts go behind: its own, else the side's where the bundle
    declares a prompt of that name (encode_query's "query"), else the bundle's default."""
    if request.prompt_name is not None:
        return request.prompt_name
    if request.input_type is not None and request.input_type in ctx.spec.prompts:
        return request.input_type
    return None


def static_vectors(ctx: TaskContext, texts: list[str], truncate: bool) -> list[np.ndarray]:
    """SparseStaticEmbedding: each vocabulary id the text's pieces hold (no special tokens),
    counted once, weighted by the bundle's learned weight for it."""
    sparse = ctx.spec.sparse
    weights = ctx.static_weights
    assert sparse is not None and weights is not None, "a static side has weights"
    most = sparse.static_max_len
    out = []
    for text in texts:
        ids = tokenize(ctx.tokenizer, text, add_special_tokens=False).ids
        if most is not None and len(ids) > most:
            if not truncate:
                raise ctx.too_long(len(ids))
            ids = ids[:most]
        vector = np.zeros(len(weights), dtype=np.float32)
        present = np.unique(np.asarray(ids, dtype=np.int64))
        vector[present] = weights[present]
        out.append(vector)
    return out


def entries(
    ctx: TaskContext, vector: np.ndarray, top_k: int | None, min_weight: float, tokens: bool
) -> list[dict[str, Any]]:
    """A dense weight vector as TEI's sparse entries: the non-zero weights (at least
    `min_weight`; the `top_k` largest), in index order."""
    keep = np.flatnonzero((vector > 0) & (vector >= min_weight))
    if top_k is not None and len(keep) > top_k:
        largest = np.argpartition(-vector[keep], top_k - 1)[:top_k]
        keep = np.sort(keep[largest])
    values = vector[keep].tolist()
    if not tokens:
        return [{"index": int(i), "value": v} for i, v in zip(keep, values, strict=True)]
    name = ctx.tokenizer.id_to_token
    return [
        {"index": int(i), "value": v, "token": name(int(i))}
        for i, v in zip(keep, values, strict=True)
    ]


class EmbedSparse(Task):
    path = "/embed_sparse"
    capability = "sparse"
    reads = ("sparse_embeddings",)
    request = SparseRequest
    response = list[list[SparseValue]]
    summary = "Sparse (SPLADE) embeddings (text-embeddings-inference's /embed_sparse)"
    example: ClassVar[dict[str, Any]] = {"inputs": "Where was Aristotle born?"}

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        if request.top_k is not None:  # the answer's size is bounded before any work
            width = ENTRY_BYTES + (24 if request.return_tokens else 0)
            size = len(items) * min(request.top_k, ctx.spec.tokenizer.vocab_size) * width
            if size > limits.max_response_bytes:
                raise TooLarge(
                    f"{len(items):,} vectors of up to {request.top_k} weights may take "
                    f"{size:,} bytes; the answer limit is {limits.max_response_bytes:,} "
                    "(BERTSERVE_MAX_RESPONSE_BYTES). Send fewer inputs a request, or a smaller "
                    "top_k"
                )
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: SparseRequest
    ) -> tuple[list[Row], SparsePlan]:
        mode = long_mode(ctx, request.long_input, request.truncate)
        prompt = prompt_for(ctx, request)
        sparse = ctx.spec.sparse
        if sparse is not None and sparse.static_side == side(ctx, request.input_type):
            if mode == "chunk":
                raise InvalidInput(
                    f"model {ctx.spec.name} weights {sparse.static_side} texts by their tokens "
                    "without the encoder: there is no window to chunk for (long_input "
                    '"truncate" cuts them at the model\'s length)'
                )
            texts = [prompted(ctx, prompt, ctx.check_text(t)) for t in items]
            return [], SparsePlan(None, static_vectors(ctx, texts, mode == "truncate"))
        rows, groups = text_rows(ctx, items, prompt, mode, request.truncation_direction)
        return rows, SparsePlan(groups)

    def finish(
        self, ctx: TaskContext, prepared: SparsePlan, results: list[RowResult], request: Any
    ) -> list[Any]:
        vectors = prepared.static
        if vectors is None:
            assert prepared.groups is not None
            # A chunked text's vector: its chunks' max, as SPLADE pools its tokens.
            vectors = [
                np.max([results[i].outputs["sparse_embeddings"] for i in span], axis=0)
                for span in prepared.groups.spans
            ]
        args = (request.top_k, request.min_weight, request.return_tokens)
        return [entries(ctx, v.astype(np.float32), *args) for v in vectors]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers  # TEI answers a list of vectors, also for one input


EMBED_SPARSE = EmbedSparse()
