"""Rerank: a cross-encoder scores each (query, document) pair, best first. `/rerank` speaks
text-embeddings-inference's schema, `/v1/rerank` Cohere's and Jina's, both on bundles exported
with the `rerank` task (a sequence classifier with one output, as sentence-transformers'
CrossEncoder saves one).

Every pair is a row in the batcher, so a request's documents batch with each other and with
other requests'. The score is the sigmoid of the model's logit, as `CrossEncoder.predict` gives
for a one-label model (TEI's `raw_scores` returns the logit). A pair longer than the model takes
is cut, the document giving way (longest first), where the request allows it (`truncate`, or
the service's `auto_truncate` where it says nothing; the Cohere schema always truncates), else
it is a 413. Cohere's `max_tokens_per_doc` cuts each document to that many pieces first, and
`rank_fields` ranks object documents on the fields it names, written as "field: value" lines,
as Cohere's API does (a document with none of them, on all of its fields).

A multivector (ColBERT) bundle serves the same routes by late interaction, as vLLM's /score
does: the query and each document are encoded apart (framed as its /v1/multi-vector sides:
runtime/tasks/multivector.py), a document's score is MaxSim (each query vector's best dot
product with the document's, summed), unbounded and unsquashed (`raw_scores` changes nothing),
and a document is cut at the bundle's document length, as ColBERT cuts it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput
from bertserve.runtime.schemas import PRIORITY_TEXT, WHOLE, Priority, Request, Text
from bertserve.runtime.tasks.chunks import (
    BEST_OVERLAP_TOKENS,
    Groups,
    LongInput,
    chunk_rows,
    long_mode,
)
from bertserve.runtime.tasks.common import (
    Direction,
    Task,
    TaskContext,
    row,
    sigmoid,
    tokenize,
    usage,
)
from bertserve.runtime.tasks.embed import LongInputField, Truncate
from bertserve.runtime.tasks.multivector import framed_rows, maxsim, unit_vectors

Documents = Annotated[list[Text], Field(min_length=1)]


TopN = Annotated[int, Field(ge=1), WHOLE] | None


class RerankRequest(Request):
    query: Text
    texts: Documents = Field(description="at most BERTSERVE_MAX_RERANK_DOCUMENTS")
    raw_scores: bool = Field(False, description="the model's logit instead of its sigmoid")
    return_text: bool = False
    truncate: Truncate = None
    long_input: LongInputField = None
    truncation_direction: Direction = Field(
        "Right", description="which end of an over-long query or document is cut"
    )
    top_n: TopN = Field(None, description="the best n results; default all (litellm sends it)")


class RankItem(BaseModel):
    index: int
    score: float
    text: str | None = None


class DocumentText(BaseModel):
    """A document as an object: its `text`, or with `rank_fields` the fields named there
    (Cohere v1's structured documents); other fields are kept for return_documents."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"minProperties": 1})
    # Optional but never null: without rank_fields the request's schema requires it
    # (`_text_unless_rank_fields`); a null text is refused as any other wrong type.
    text: Text = Field(None, json_schema_extra=lambda s: _no_default(s))  # type: ignore[assignment]


def _no_default(schema: dict[str, Any]) -> None:
    """A field left out is not null: its schema states no default (null is not a text)."""
    schema.pop("default", None)


def _text_unless_rank_fields(schema: dict[str, Any]) -> None:
    """What the service enforces, stated in the request's schema: without rank_fields an object
    document ranks on its `text`, so it must have one (a string document needs nothing)."""
    schema["anyOf"] = [
        {"required": ["rank_fields"], "properties": {"rank_fields": {"type": "array"}}},
        {
            "properties": {
                "documents": {
                    "items": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "object", "required": ["text"]},
                        ]
                    }
                }
            }
        },
    ]


class CohereRerankRequest(Request):
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra=_text_unless_rank_fields
    )
    query: Text
    documents: Annotated[list[Text | DocumentText], Field(min_length=1)] = Field(
        description="strings or {'text': ...}; at most BERTSERVE_MAX_RERANK_DOCUMENTS"
    )
    model: str | None = Field(
        None, description="a rerank bundle's name; other names get the default model"
    )
    top_n: TopN = Field(None, description="the best n results; default all")
    return_documents: bool = False
    rank_fields: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None
    ) = Field(
        None,
        description="object documents: rank on these fields, as 'field: value' lines "
        "(Cohere v1; a document with none of them on all its fields); default: their text",
    )
    max_tokens_per_doc: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="cut each document to this many tokens first (Cohere v2)"
    )
    max_chunks_per_doc: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None,
        description="a document longer than the model's window is scored by its best chunk, "
        "of its first max_chunks_per_doc (Cohere v1); left out: as long_input says",
    )
    long_input: LongInput | None = Field(
        None,
        description="(extension) a document longer than the window: truncate, or chunk (scored "
        "by its best chunk); left out: chunk if max_chunks_per_doc is set, else the service's "
        "BERTSERVE_LONG_INPUT, its error read as truncate (Cohere's API never refuses a long "
        "document)",
    )
    priority: Priority = Field(None, description=PRIORITY_TEXT)


class CohereResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class CohereRerankResponse(BaseModel):
    id: str
    results: list[CohereResult]
    model: str
    usage: RerankUsage


def pair_rows(
    ctx: TaskContext,
    query: str,
    documents: list[str],
    mode: LongInput,
    direction: Direction = "Right",
    most_chunks: int | None = None,
) -> tuple[list[Row], Groups]:
    """A row a (query, document) pair; with `mode` "chunk" a row a chunk of an over-long
    document (chunks of what the query leaves of the window, overlapping by
    BEST_OVERLAP_TOKENS; its first `most_chunks`), and which rows are whose. A query of more
    than half the window is cut to half of it there."""
    query = ctx.check_text(query, "query")
    if mode == "truncate":  # the query tokenised once, not again beside each document
        encoded = tokenize(ctx.tokenizer, query, add_special_tokens=False)
        rows = [
            row(ctx.truncated(query, ctx.check_text(d, f"document {i}"), direction, encoded))
            for i, d in enumerate(documents)
        ]
        return rows, Groups.one_each(len(rows))
    if mode != "chunk":  # "error": an over-long pair is a 413
        rows = [
            row(ctx.encode(query, ctx.check_text(d, f"document {i}")))
            for i, d in enumerate(documents)
        ]
        return rows, Groups.one_each(len(rows))
    budget = ctx.max_len - ctx.tokenizer.num_special_tokens_to_add(True)
    pieces = len(tokenize(ctx.tokenizer, query, add_special_tokens=False))
    if pieces > budget // 2:
        query, pieces = first_tokens(ctx, query, budget // 2), budget // 2
    size = budget - pieces
    overlap = min(BEST_OVERLAP_TOKENS, size // 4)
    return chunk_rows(
        ctx,
        documents,
        size,
        overlap,
        lambda d: ctx.encode(query, d, truncate=True),
        "document",
        most_chunks,
    )


@dataclass
class LateInteraction:
    """A MaxSim rerank's plan: row 0 is the query, the rest the documents in order; the
    positions of each row that score."""

    keep: list[np.ndarray]


def late_rows(ctx: TaskContext, query: str, documents: list[str]) -> tuple[list[Row], Any]:
    """The query as a query and each document as a document of the multivector bundle."""
    query = ctx.check_text(query, "query")
    documents = [ctx.check_text(d, f"document {i}") for i, d in enumerate(documents)]
    q_rows, q_keep = framed_rows(ctx, [query], True, None, truncate=True)
    d_rows, d_keep = framed_rows(ctx, documents, False, None, truncate=True)
    return q_rows + d_rows, LateInteraction(q_keep + d_keep)


def scored(prepared: Groups | LateInteraction, results: list[RowResult]) -> np.ndarray | None:
    """MaxSim scores of a late-interaction plan's documents (None for a cross-encoder's)."""
    if not isinstance(prepared, LateInteraction):
        return None
    vectors = [unit_vectors(r, k) for r, k in zip(results, prepared.keep, strict=True)]
    return np.asarray([maxsim(vectors[0], d) for d in vectors[1:]])


def best_chunks(results: list[RowResult], groups: Groups) -> np.ndarray:
    """Each document's logit: its best chunk's."""
    raw = logits(results)
    return np.asarray([raw[span.start : span.stop].max() for span in groups.spans])


def first_tokens(ctx: TaskContext, text: str, most: int) -> str:
    """`text` up to the end of its `most`-th word piece (Cohere's max_tokens_per_doc)."""
    enc = tokenize(ctx.tokenizer, text, add_special_tokens=False)
    if len(enc) <= most:
        return text
    span = enc.token_to_chars(most - 1)
    return text[: span[1]] if span else text


def field_text(value: Any) -> str:
    """A field's value as a rank_fields line writes it: a string as it is, else its JSON."""
    # json, not orjson: a body may hold integers past 64 bits, which orjson cannot write.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def document_text(document: str | DocumentText, fields: list[str] | None, index: int) -> str:
    """What a document is ranked on: a string as it is; an object's text, or with
    `rank_fields` the fields it has of those named, as "field: value" lines."""
    if isinstance(document, str):
        return document
    values = document.model_dump(exclude_none=True)
    if fields is None:
        if document.text is None:
            raise InvalidInput(
                f"documents.{index}: an object document needs a 'text' field, or rank_fields "
                "naming the fields to rank on"
            )
        return document.text
    # A document with none of the fields named (a corpus of mixed shapes) ranks on all of its
    # own, rather than being refused: the schema cannot say which fields each object has.
    named = [name for name in fields if name in values] or list(values)
    return "\n".join(f"{name}: {field_text(values[name])}" for name in named)


def logits(results: list[RowResult]) -> np.ndarray:
    return np.asarray([float(r.outputs["logits"].reshape(-1)[0]) for r in results])


def best_first(scores: np.ndarray) -> list[int]:
    """Indices by score, highest first; equal scores keep the documents' order."""
    return np.argsort(-scores, kind="stable").tolist()


class Rerank(Task):
    path = "/rerank"
    capability = "rerank"
    reads = ("logits",)
    request = RerankRequest
    response = list[RankItem]
    summary = "Documents ranked by relevance to a query (text-embeddings-inference's /rerank)"
    example: ClassVar[dict[str, Any]] = {
        "query": "What is the capital of France?",
        "texts": ["Paris is the capital of France.", "Berlin is in Germany."],
    }
    batch_limit = rows_limit = "max_rerank_documents"
    items_name = "documents"
    items_field = ("texts",)

    def inputs(self, request: RerankRequest) -> tuple[list[Any], bool]:
        return list(request.texts), False

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        return len(request.query) * len(items) + sum(len(t) for t in items)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: RerankRequest
    ) -> tuple[list[Row], Any]:
        if ctx.spec.multivector is not None:
            return late_rows(ctx, request.query, items)
        mode = long_mode(ctx, request.long_input, request.truncate)
        return pair_rows(ctx, request.query, items, mode, request.truncation_direction)

    def finish(
        self, ctx: TaskContext, prepared: Any, results: list[RowResult], request: RerankRequest
    ) -> list[Any]:
        late = scored(prepared, results)
        if late is not None:
            scores = late
        else:
            raw = best_chunks(results, prepared)
            scores = raw if request.raw_scores else sigmoid(raw)
        return [
            {"index": i, "score": float(scores[i])}
            | ({"text": request.texts[i]} if request.return_text else {})
            for i in best_first(scores)[: request.top_n]
        ]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers


class CohereRerank(Task):
    path = "/v1/rerank"
    capability = "rerank"
    reads = ("logits",)
    request = CohereRerankRequest
    response = CohereRerankResponse
    summary = "Documents ranked by relevance to a query (Cohere's and Jina's /v1/rerank)"
    example: ClassVar[dict[str, Any]] = {
        "query": "What is the capital of France?",
        "documents": ["Paris is the capital of France.", "Berlin is in Germany."],
        "top_n": 1,
    }
    lenient_model_name = True
    batch_limit = rows_limit = "max_rerank_documents"
    items_name = "documents"
    items_field = ("documents",)

    def inputs(self, request: CohereRerankRequest) -> tuple[list[Any], bool]:
        fields = request.rank_fields
        return [document_text(d, fields, i) for i, d in enumerate(request.documents)], False

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        return len(request.query) * len(items) + sum(len(t) for t in items)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: CohereRerankRequest
    ) -> tuple[list[Row], Any]:
        most = request.max_tokens_per_doc
        if most is not None:  # cut after its length is checked, before its pairing
            items = [
                first_tokens(ctx, ctx.check_text(t, f"document {i}"), most)
                for i, t in enumerate(items)
            ]
        if ctx.spec.multivector is not None:
            return late_rows(ctx, request.query, items)
        mode: LongInput = request.long_input or (
            "chunk" if request.max_chunks_per_doc is not None else ctx.long_input
        )
        if mode == "error":  # Cohere's API cuts what it does not chunk
            mode = "truncate"
        rows, groups = pair_rows(
            ctx, request.query, items, mode, most_chunks=request.max_chunks_per_doc
        )
        return rows, groups

    def finish(
        self,
        ctx: TaskContext,
        prepared: Any,
        results: list[RowResult],
        request: CohereRerankRequest,
    ) -> list[Any]:
        late = scored(prepared, results)
        scores = late if late is not None else sigmoid(best_chunks(results, prepared))
        order = best_first(scores)[: request.top_n]
        return [
            {"index": i, "relevance_score": float(scores[i])}
            | ({"document": returned(request.documents[i])} if request.return_documents else {})
            for i in order
        ]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return {"id": uuid.uuid4().hex, "results": answers, "model": model, "usage": usage(rows)}

    def model_name(self, request: CohereRerankRequest) -> str | None:
        return request.model


def returned(document: str | DocumentText) -> dict[str, Any] | orjson.Fragment:
    """A document as Cohere returns it: {"text": ...} for a string, else the object as sent,
    written by json (as it was read), since its integers may be past orjson's 64 bits."""
    if isinstance(document, str):
        return {"text": document}
    written = json.dumps(document.model_dump(exclude_none=True), ensure_ascii=False)
    return orjson.Fragment(written.encode())


class CohereRerankV2(CohereRerank):
    path = "/v2/rerank"
    summary = "Documents ranked by relevance to a query (Cohere's v2 client)"


RERANK = Rerank()
COHERE_RERANK = CohereRerank()
COHERE_RERANK_V2 = CohereRerankV2()
