"""Rerank: a cross-encoder scores each (query, document) pair, best first. `/rerank` speaks
text-embeddings-inference's schema, `/v1/rerank` Cohere's and Jina's, both on bundles exported
with the `rerank` task (a sequence classifier with one output, as sentence-transformers'
CrossEncoder saves one).

Every pair is a row in the batcher, so a request's documents batch with each other and with
other requests'. The score is the sigmoid of the model's logit, as `CrossEncoder.predict` gives
for a one-label model (TEI's `raw_scores` returns the logit). A pair longer than the model takes
is cut, the document giving way (longest first), where the request allows it (`truncate`; the
Cohere schema always truncates), else it is a 413.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.schemas import STRICT, WHOLE, Request, Text
from bertserve.runtime.tasks.common import Task, TaskContext, row, sigmoid, usage

Documents = Annotated[list[Text], Field(min_length=1)]


class RerankRequest(Request):
    query: Text
    texts: Documents = Field(description="at most BERTSERVE_MAX_RERANK_DOCUMENTS")
    raw_scores: bool = Field(False, description="the model's logit instead of its sigmoid")
    return_text: bool = False
    truncate: bool = Field(False, description="cut an over-long pair instead of a 413")
    truncation_direction: Literal["Right"] = Field(
        "Right", description="the end of the document is cut (the only direction served)"
    )


class RankItem(BaseModel):
    index: int
    score: float
    text: str | None = None


class DocumentText(BaseModel):
    model_config = STRICT
    text: Text


class CohereRerankRequest(Request):
    query: Text
    documents: Annotated[list[Text | DocumentText], Field(min_length=1)] = Field(
        description="strings or {'text': ...}; at most BERTSERVE_MAX_RERANK_DOCUMENTS"
    )
    model: str | None = Field(
        None, description="a rerank bundle's name; other names get the default model"
    )
    top_n: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="the best n results; default all"
    )
    return_documents: bool = False


class CohereResult(BaseModel):
    index: int
    relevance_score: float
    document: DocumentText | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class CohereRerankResponse(BaseModel):
    id: str
    results: list[CohereResult]
    model: str
    usage: RerankUsage


def pair_rows(ctx: TaskContext, query: str, documents: list[str], truncate: bool) -> list[Row]:
    query = ctx.check_text(query, "query")
    return [
        row(ctx.encode(query, ctx.check_text(d, f"document {i}"), truncate=truncate))
        for i, d in enumerate(documents)
    ]


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
    ) -> tuple[list[Row], None]:
        return pair_rows(ctx, request.query, items, request.truncate), None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: RerankRequest
    ) -> list[Any]:
        raw = logits(results)
        scores = raw if request.raw_scores else sigmoid(raw)
        return [
            {"index": i, "score": float(scores[i])}
            | ({"text": request.texts[i]} if request.return_text else {})
            for i in best_first(scores)
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
        return [d if isinstance(d, str) else d.text for d in request.documents], False

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        return len(request.query) * len(items) + sum(len(t) for t in items)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: CohereRerankRequest
    ) -> tuple[list[Row], list[str]]:
        return pair_rows(ctx, request.query, items, truncate=True), items

    def finish(
        self,
        ctx: TaskContext,
        prepared: list[str],
        results: list[RowResult],
        request: CohereRerankRequest,
    ) -> list[Any]:
        scores = sigmoid(logits(results))
        order = best_first(scores)[: request.top_n]
        return [
            {"index": i, "relevance_score": float(scores[i])}
            | ({"document": {"text": prepared[i]}} if request.return_documents else {})
            for i in order
        ]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return {"id": uuid.uuid4().hex, "results": answers, "model": model, "usage": usage(rows)}

    def model_name(self, request: CohereRerankRequest) -> str | None:
        return request.model


class CohereRerankV2(CohereRerank):
    path = "/v2/rerank"
    summary = "Documents ranked by relevance to a query (Cohere's v2 client)"


RERANK = Rerank()
COHERE_RERANK = CohereRerank()
COHERE_RERANK_V2 = CohereRerankV2()
