"""Sentence embeddings, the sixth task: `/embed` in text-embeddings-inference's schema and
`/v1/embeddings` in OpenAI's, both on bundles exported with the `embed` task.

The graph pools the encoder's last hidden states (mean over real tokens, or [CLS], as
`bundle.json` "pooling" says); normalising to unit length happens here, as the request (TEI's
`normalize`) or the bundle's default asks. Over-long inputs are a 413 unless `truncate` is set.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from runtime.batching import Row, RowResult
from runtime.schemas import Request, Text
from runtime.tasks.common import Task, TaskContext, row

Texts = Text | Annotated[list[Text], Field(min_length=1)]


class EmbedRequest(Request):
    inputs: Texts
    normalize: bool = True
    truncate: bool = False


class OpenAIEmbeddingsRequest(Request):
    input: Texts
    model: str | None = Field(
        None, description="an embedding bundle's name; other names get the default model"
    )
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: Usage


def embeddings(results: list[RowResult], normalize: bool) -> list[np.ndarray]:
    out = []
    for result in results:
        vector = result.outputs["embeddings"].astype(np.float32)
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        out.append(vector)
    return out


class Embed(Task):
    path = "/embed"
    capability = "embed"
    reads = ("embeddings",)
    request = EmbedRequest
    response = list[list[float]]
    summary = "Sentence embeddings (text-embeddings-inference's /embed)"
    example: ClassVar[dict[str, Any]] = {"inputs": "A man is eating food."}

    def prepare(
        self, ctx: TaskContext, items: list[str], request: EmbedRequest
    ) -> tuple[list[Row], None]:
        rows = [row(ctx.encode(ctx.check_text(t), truncate=request.truncate)) for t in items]
        return rows, None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: EmbedRequest
    ) -> list[Any]:
        return [v.tolist() for v in embeddings(results, request.normalize)]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers  # TEI answers a list of vectors, also for one input


class OpenAIEmbeddings(Task):
    path = "/v1/embeddings"
    capability = "embed"
    reads = ("embeddings",)
    request = OpenAIEmbeddingsRequest
    response = EmbeddingList
    summary = "Sentence embeddings in OpenAI's schema (for RAG frameworks' OpenAI clients)"
    example: ClassVar[dict[str, Any]] = {"input": "A man is eating food.", "model": "minilm-embed"}
    lenient_model_name = True

    def inputs(self, request: OpenAIEmbeddingsRequest) -> tuple[list[Any], bool]:
        items = request.input
        return ([items] if isinstance(items, str) else list(items)), isinstance(items, str)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: OpenAIEmbeddingsRequest
    ) -> tuple[list[Row], None]:
        return [row(ctx.encode(ctx.check_text(t))) for t in items], None

    def finish(
        self,
        ctx: TaskContext,
        prepared: None,
        results: list[RowResult],
        request: OpenAIEmbeddingsRequest,
    ) -> list[Any]:
        normalize = ctx.spec.pooling.normalize if ctx.spec.pooling else True
        vectors = embeddings(results, normalize)
        if request.encoding_format == "base64":  # little-endian float32, as OpenAI sends it
            return [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        return [v.tolist() for v in vectors]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        tokens = sum(len(r) for r in rows)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": vector}
                for i, vector in enumerate(answers)
            ],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def model_name(self, request: OpenAIEmbeddingsRequest) -> str | None:
        return request.model


EMBED = Embed()
OPENAI_EMBEDDINGS = OpenAIEmbeddings()
