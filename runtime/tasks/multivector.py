"""Multi-vector (ColBERT) embeddings: `/v1/multi-vector` in Jina AI's schema (the published
route for ColBERT vectors: `input`, `input_type` "query" | "document", `dimensions`,
`embedding_type`), on bundles exported from a PyLate `ColBERT` checkpoint, and the MaxSim score
/rerank computes with them.

A text is framed as PyLate's `ColBERT.tokenize` frames it (`frame`): the side's marker token
("[unused0]"/"[unused1]", or "[Q] "/"[D] " added to the vocabulary) after the first special
token; a query cut or padded with [MASK] to `query_length` positions (query expansion), the
padding attended or not as the checkpoint says; a document cut to `document_length`. The graph
projects every position (the checkpoint's Dense layers) and normalises it; the answer holds a
query's every position and a document's positions less its skiplist tokens (punctuation), as
`ColBERT.encode` returns them. The framing is shared with the trainer
(model/training/colbert.py), so a model is served as it was trained.

An answer grows with its inputs' lengths (a vector a kept token), so its size is checked
against the answer limit once the inputs are framed, before the model runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.bundle import MultiVectorSpec
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import WHOLE, Request
from bertserve.runtime.tasks.common import Task, TaskContext, tokenize, usage
from bertserve.runtime.tasks.embed import PromptName, Texts, answer_bytes, prompted

VECTORS = "multivector_embeddings"
Side = Literal["query", "document"]


def frame(ids: Sequence[int], query: bool, spec: MultiVectorSpec) -> tuple[np.ndarray, int]:
    """A text's ids (its tokenizer's, with the special tokens at both ends) framed for one
    side: (input ids, how many leading positions are attended). Longer than the side's length,
    its pieces are cut (the trailing special token kept), as PyLate's tokenizer truncates."""
    length = spec.query_length if query else spec.document_length
    prefix = spec.query_prefix_id if query else spec.document_prefix_id
    room = length - (prefix is not None)
    body = list(ids)
    if len(body) > room:
        body = body[: room - 1] + body[-1:]
    attended = len(body) + (prefix is not None)
    if query and spec.query_expansion:
        body += [spec.expansion_id] * (room - len(body))
        if spec.attend_to_expansion:
            attended = length
    if prefix is not None:
        body.insert(1, prefix)
    return np.asarray(body, dtype=np.int64), attended


def kept(ids: np.ndarray, attended: int, query: bool, spec: MultiVectorSpec) -> np.ndarray:
    """The positions whose vectors the answer holds: a query's all (its expansion included),
    a document's attended ones less its skiplist tokens."""
    if query:
        return np.arange(len(ids) if spec.query_expansion else attended)
    skip = np.isin(ids[:attended], np.asarray(spec.skip_ids, dtype=np.int64))
    return np.flatnonzero(~skip)


def too_long(ctx: TaskContext, tokens: int, most: int, side: str) -> InvalidInput:
    return InvalidInput(
        f"an input of {tokens} tokens is longer than model {ctx.spec.name}'s {side} length "
        f"({most}); send truncate true (the default) to cut it there, as ColBERT does"
    )


def framed_rows(
    ctx: TaskContext, texts: list[str], query: bool, prompt: str | None, truncate: bool
) -> tuple[list[Row], list[np.ndarray]]:
    """A row a text for one side, and each row's kept positions."""
    spec = ctx.spec.multivector
    assert spec is not None, "a multivector bundle"
    most = spec.query_length if query else spec.document_length
    room = most - ((spec.query_prefix_id if query else spec.document_prefix_id) is not None)
    rows, keep = [], []
    for text in texts:
        ids = tokenize(ctx.tokenizer, prompted(ctx, prompt, ctx.check_text(text))).ids
        if len(ids) > room and not truncate:
            # Counted as the length is: the marker's position included.
            raise too_long(ctx, len(ids) + most - room, most, "query" if query else "document")
        framed, attended = frame(ids, query, spec)
        rows.append(Row(framed, np.zeros_like(framed), attend=attended))
        keep.append(kept(framed, attended, query, spec))
    return rows, keep


def unit_vectors(result: RowResult, keep: np.ndarray) -> np.ndarray:
    return result.outputs[VECTORS][keep].astype(np.float32)


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """ColBERT's late interaction: each query vector's best dot product with the document's
    vectors, summed (PyLate's `colbert_scores`)."""
    return float((query @ document.T).max(axis=1).sum())


class MultiVectorRequest(Request):
    input: Texts = Field(description="a text or a list of texts")
    model: str | None = Field(
        None, description="a multivector bundle's name; other names get the default one"
    )
    input_type: Side = Field(
        "document",
        description="queries (marker, padded with [MASK] to the query length) or documents "
        "(marker, punctuation left out), as ColBERT.encode(is_query=...)",
    )
    embedding_type: Literal["float"] = Field("float", description="float vectors only")
    dimensions: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="the model's own width (others are refused: no Matryoshka training)"
    )
    truncate: bool = Field(
        True,
        description="cut a text at its side's length, as ColBERT does; false: a longer text "
        "is refused",
    )
    prompt_name: PromptName = None


class MultiVectorItem(BaseModel):
    object: Literal["embeddings"] = "embeddings"
    index: int
    embeddings: list[list[float]] = Field(description="a unit vector a kept token")


class MultiVectorResponse(BaseModel):
    model: str
    object: Literal["list"] = "list"
    usage: dict[str, int]
    data: list[MultiVectorItem]


class MultiVector(Task):
    path = "/v1/multi-vector"
    capability = "multivector"
    reads = (VECTORS,)
    request = MultiVectorRequest
    response = MultiVectorResponse
    summary = "Multi-vector (ColBERT) embeddings (Jina AI's /v1/multi-vector)"
    example: ClassVar[dict[str, Any]] = {"input": ["Where was Aristotle born?"]}
    lenient_model_name = True
    items_name = "input"
    items_field = ("input",)

    def model_name(self, request: MultiVectorRequest) -> str | None:
        return request.model

    def inputs(self, request: MultiVectorRequest) -> tuple[list[Any], bool]:
        items = request.input
        single = not isinstance(items, list)
        return ([items] if single else list(items)), single

    def prepare(
        self, ctx: TaskContext, items: list[str], request: MultiVectorRequest
    ) -> tuple[list[Row], list[np.ndarray]]:
        spec = ctx.spec.multivector
        assert spec is not None, "served by multivector bundles only"
        if request.dimensions is not None and request.dimensions != spec.dim:
            raise InvalidInput(
                f"dimensions {request.dimensions}: model {ctx.spec.name}'s vectors have "
                f"{spec.dim} components, and no other width is served"
            )
        query = request.input_type == "query"
        rows, keep = framed_rows(ctx, items, query, request.prompt_name, request.truncate)
        vectors = sum(len(k) for k in keep)
        size = answer_bytes(ctx, vectors, spec.dim, base64=False)
        if size > ctx.max_response_bytes:
            raise TooLarge(
                f"{vectors:,} vectors of {spec.dim} components may take {size:,} bytes; the "
                f"answer limit is {ctx.max_response_bytes:,} (BERTSERVE_MAX_RESPONSE_BYTES). "
                "Send fewer or shorter inputs a request"
            )
        return rows, keep

    def finish(
        self, ctx: TaskContext, prepared: list[np.ndarray], results: list[RowResult], request: Any
    ) -> list[Any]:
        return [unit_vectors(r, k) for r, k in zip(results, prepared, strict=True)]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return {
            "model": model,
            "object": "list",
            "usage": usage(rows),
            "data": [
                {"object": "embeddings", "index": i, "embeddings": v} for i, v in enumerate(answers)
            ],
        }


MULTI_VECTOR = MultiVector()
