"""Sentence embeddings: `/embed` and `/similarity` in text-embeddings-inference's schema and
`/v1/embeddings` in OpenAI's, all on bundles exported with the `embed` task.

The graph pools the encoder's last hidden states (mean over real tokens, or [CLS], as
`bundle.json` "pooling" says); normalising to unit length happens here, as the request (TEI's
`normalize`) or the bundle's default asks. OpenAI's `dimensions` keeps the first components and
normalises again, as sentence-transformers' `truncate_dim` does. A request's `prompt_name`
(or the bundle's default prompt) puts the bundle's prompt text before each input, as
sentence-transformers' `encode(prompt_name=...)` does. Over-long inputs are a 413 unless
`truncate` is set.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput
from bertserve.runtime.schemas import STRICT, WHOLE, Params, Request, Text
from bertserve.runtime.tasks.common import Task, TaskContext, row, usage

Texts = Text | Annotated[list[Text], Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]
PromptName = Annotated[
    str | None,
    Field(
        description="a prompt the bundle declares (GET /models: prompts), put before each input; "
        "default: the bundle's default prompt, if it has one"
    ),
]


class EmbedRequest(Request):
    inputs: Texts
    normalize: bool = True
    truncate: bool = False
    prompt_name: PromptName = None


class OpenAIEmbeddingsRequest(Request):
    input: Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)] = Field(
        description="a text, a list of texts, or token ids of the model's own tokenizer (one "
        "list of ids, or a list of them): ids are put between the model's special tokens"
    )
    model: str | None = Field(
        None, description="an embedding bundle's name; other names get the default model"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None,
        description="keep the first `dimensions` components, then normalise (Matryoshka-style "
        "truncation); at most the model's hidden size",
    )
    user: str | None = Field(None, description="accepted and ignored")


class SimilarityInputs(BaseModel):
    model_config = STRICT
    source_sentence: Text
    sentences: Annotated[list[Text], Field(min_length=1)]


class SimilarityParams(Params):
    truncate: bool = False
    prompt_name: PromptName = None


class SimilarityRequest(Request):
    inputs: SimilarityInputs
    parameters: SimilarityParams = SimilarityParams()


def prompted(ctx: TaskContext, name: str | None, text: str) -> str:
    """`text` behind the bundle's prompt `name` (or its default prompt): a 422 naming the
    bundle's prompts for a name it does not declare."""
    spec = ctx.spec
    name = name if name is not None else spec.default_prompt_name
    if name is None:
        return text
    prompt = spec.prompts.get(name)
    if prompt is None:
        declared = sorted(spec.prompts) or "none"
        raise InvalidInput(f"prompt_name {name!r}: model {spec.name} has prompts {declared}")
    return prompt + text


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


def text_rows(
    ctx: TaskContext, texts: list[str], prompt_name: str | None, truncate: bool
) -> list[Row]:
    """A row a text, behind its prompt (`prompted`)."""
    return [
        row(ctx.encode(prompted(ctx, prompt_name, ctx.check_text(t)), truncate=truncate))
        for t in texts
    ]


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
        return text_rows(ctx, items, request.prompt_name, request.truncate), None

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
    items_field = ("input",)
    capability = "embed"
    reads = ("embeddings",)
    request = OpenAIEmbeddingsRequest
    response = EmbeddingList
    summary = "Sentence embeddings in OpenAI's schema (for RAG frameworks' OpenAI clients)"
    example: ClassVar[dict[str, Any]] = {"input": "A man is eating food.", "model": "minilm-embed"}
    lenient_model_name = True

    def inputs(self, request: OpenAIEmbeddingsRequest) -> tuple[list[Any], bool]:
        items = request.input
        if isinstance(items, str):
            return [items], True
        if isinstance(items[0], int):  # one text's token ids
            return [items], False
        return list(items), False

    def texts(self, items: list[Any]) -> list[str]:
        return [t for t in items if isinstance(t, str)]

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        wanted, width = request.dimensions, ctx.spec.architecture.hidden_size
        if wanted is not None and wanted > width:
            raise InvalidInput(
                f"dimensions {wanted} is more than model {ctx.spec.name}'s {width} components"
            )
        return sum(len(t) for t in items)  # characters, or ids (about as costly to encode)

    def prepare(
        self, ctx: TaskContext, items: list[Any], request: OpenAIEmbeddingsRequest
    ) -> tuple[list[Row], None]:
        rows = [
            ctx.encode_ids(t) if isinstance(t, list) else row(ctx.encode(ctx.check_text(t)))
            for t in items
        ]
        return rows, None

    def finish(
        self,
        ctx: TaskContext,
        prepared: None,
        results: list[RowResult],
        request: OpenAIEmbeddingsRequest,
    ) -> list[Any]:
        normalize = ctx.spec.pooling.normalize if ctx.spec.pooling else True
        vectors = embeddings(results, normalize)
        if request.dimensions is not None:
            vectors = [v[: request.dimensions] for v in vectors]
            if normalize:
                vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
        if request.encoding_format == "base64":  # little-endian float32, as OpenAI sends it
            return [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        return [v.tolist() for v in vectors]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": vector}
                for i, vector in enumerate(answers)
            ],
            "model": model,
            "usage": usage(rows),
        }

    def model_name(self, request: OpenAIEmbeddingsRequest) -> str | None:
        return request.model


class Similarity(Task):
    path = "/similarity"
    items_field, items_besides = ("inputs", "sentences"), 1  # and the source sentence
    capability = "embed"
    reads = ("embeddings",)
    request = SimilarityRequest
    response = list[float]
    summary = "Cosine similarity of a sentence to others (text-embeddings-inference's /similarity)"
    example: ClassVar[dict[str, Any]] = {
        "inputs": {"source_sentence": "A man is eating food.", "sentences": ["A man eats."]}
    }

    def inputs(self, request: SimilarityRequest) -> tuple[list[Any], bool]:
        return [request.inputs.source_sentence, *request.inputs.sentences], False

    def prepare(
        self, ctx: TaskContext, items: list[str], request: SimilarityRequest
    ) -> tuple[list[Row], None]:
        params = request.parameters
        return text_rows(ctx, items, params.prompt_name, params.truncate), None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: Any
    ) -> list[Any]:
        source, *others = embeddings(results, normalize=True)
        return [float(source @ other) for other in others]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers


EMBED = Embed()
OPENAI_EMBEDDINGS = OpenAIEmbeddings()
SIMILARITY = Similarity()
