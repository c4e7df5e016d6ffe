"""Sentence embeddings: `/embed` and `/similarity` in text-embeddings-inference's schema and
`/v1/embeddings` in OpenAI's, all on bundles exported with the `embed` task.

The graph pools the encoder's last hidden states (mean over real tokens, or [CLS], as
`bundle.json` "pooling" says); normalising to unit length happens here, as the request (TEI's
`normalize`) or the bundle's default asks. OpenAI's `dimensions` keeps the first components and
normalises again, as sentence-transformers' `truncate_dim` does. A request's `prompt_name`
(or the bundle's default prompt) puts the bundle's prompt text before each input, as
sentence-transformers' `encode(prompt_name=...)` does. Over-long inputs are a 413 unless
`truncate` is set (or, where a request leaves it out, the service's `auto_truncate`); then the
end of the text gives way, or its start with `truncation_direction: "Left"`.

Vectors are answered as float32 (orjson's shortest float32 form: every value read back as
float32 is the model's exactly): for 2,048 unit vectors of 384 components, 12 bytes a float
against float64 digits' 21, written 2.5x faster.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import CLOSED, STRICT, WHOLE, Params, Request, Text
from bertserve.runtime.tasks.common import Direction, Task, TaskContext, row, usage

Texts = Text | Annotated[list[Text], Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]
PromptName = Annotated[
    str | None,
    Field(
        description="a prompt the bundle declares (GET /models: prompts), put before each input; "
        "default: the bundle's default prompt, if it has one"
    ),
]


Truncate = Annotated[
    bool | None,
    Field(
        description="cut an input longer than the model takes instead of a 413; left out: the "
        "service's setting (BERTSERVE_AUTO_TRUNCATE, default false)"
    ),
]
TruncationDirection = Annotated[
    Direction, Field(description="which end of an over-long input is cut")
]
Dimensions = Annotated[
    Annotated[int, Field(ge=1), WHOLE] | None,
    Field(
        description="keep the first `dimensions` components, then normalise (Matryoshka-style "
        "truncation); at most the model's hidden size"
    ),
]


class EmbedRequest(Request):
    inputs: Texts
    normalize: bool = True
    truncate: Truncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    dimensions: Dimensions = None


class OpenAIEmbeddingsRequest(Request):
    model_config = CLOSED  # OpenAI refuses fields it does not know; so does this route

    input: Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)] = Field(
        description="a text, a list of texts, or token ids of the model's own tokenizer (one "
        "list of ids, or a list of them): ids are put between the model's special tokens"
    )
    model: str | None = Field(
        None, description="an embedding bundle's name; other names get the default model"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions = None
    user: str | None = Field(None, description="accepted and ignored")
    truncate: Truncate = None  # an extension: OpenAI's API has no such field
    # Jina's embeddings API: the same route with more fields (langchain's JinaEmbeddings).
    normalized: bool | None = Field(
        None, description="(Jina) unit-length vectors; default: as the bundle pools"
    )
    embedding_type: Literal["float", "base64"] | None = Field(
        None, description="(Jina) as encoding_format; binary types are not served"
    )
    task: str | None = Field(None, description="(Jina) accepted and ignored")
    late_chunking: bool | None = Field(None, description="(Jina) accepted and ignored")

    @property
    def base64(self) -> bool:
        """Vectors as base64 of little-endian float32 (OpenAI's `encoding_format`, Jina's
        `embedding_type`)."""
        return (self.embedding_type or self.encoding_format) == "base64"


class SimilarityInputs(BaseModel):
    model_config = STRICT
    source_sentence: Text
    sentences: Annotated[list[Text], Field(min_length=1)]


class SimilarityParams(Params):
    truncate: Truncate = None
    truncation_direction: TruncationDirection = "Right"
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


def embeddings(
    results: list[RowResult], normalize: bool, dimensions: int | None = None
) -> list[np.ndarray]:
    """Each row's vector as float32: its first `dimensions` components, if asked, then of unit
    length if `normalize` (sentence-transformers' truncate_dim, then normalize)."""
    out = []
    for result in results:
        vector = result.outputs["embeddings"].astype(np.float32)[:dimensions]
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        out.append(vector)
    return out


def check_dimensions(ctx: TaskContext, wanted: int | None) -> None:
    width = ctx.spec.architecture.hidden_size
    if wanted is not None and wanted > width:
        raise InvalidInput(
            f"dimensions {wanted} is more than model {ctx.spec.name}'s {width} components"
        )


def answer_bytes(ctx: TaskContext, vectors: int, dimensions: int | None, base64: bool) -> int:
    """At most how large an answer of `vectors` vectors is: a float32 is at most 15 characters
    of JSON (-1.2345678e-38,), or 4 bytes as base64's 16/3 characters."""
    width = dimensions or ctx.spec.architecture.hidden_size
    return vectors * (width * (6 if base64 else 15) + 64)


def check_answer(ctx: TaskContext, vectors: int, dimensions: int | None, base64: bool, limits: Any):
    """Refuse, before any work, a request whose answer would pass max_response_bytes."""
    size, most = answer_bytes(ctx, vectors, dimensions, base64), limits.max_response_bytes
    if size > most:
        raise TooLarge(
            f"{vectors} vectors of {dimensions or ctx.spec.architecture.hidden_size} components "
            f"may take {size:,} bytes; the answer limit is {most:,} "
            "(BERTSERVE_MAX_RESPONSE_BYTES). Send fewer inputs a request, or ask for fewer "
            "dimensions"
        )


def text_rows(
    ctx: TaskContext,
    texts: list[str],
    prompt_name: str | None,
    truncate: bool | None,
    direction: Direction = "Right",
) -> list[Row]:
    """A row a text, behind its prompt (`prompted`)."""
    cut = ctx.truncating(truncate)
    return [
        row(
            ctx.encode(
                prompted(ctx, prompt_name, ctx.check_text(t)), truncate=cut, direction=direction
            )
        )
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

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        check_dimensions(ctx, request.dimensions)
        check_answer(ctx, len(items), request.dimensions, False, limits)
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: EmbedRequest
    ) -> tuple[list[Row], None]:
        rows = text_rows(
            ctx, items, request.prompt_name, request.truncate, request.truncation_direction
        )
        return rows, None

    def finish(
        self, ctx: TaskContext, prepared: None, results: list[RowResult], request: EmbedRequest
    ) -> list[Any]:
        return embeddings(results, request.normalize, request.dimensions)

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
        check_dimensions(ctx, request.dimensions)
        check_answer(ctx, len(items), request.dimensions, request.base64, limits)
        return sum(len(t) for t in items)  # characters, or ids (about as costly to encode)

    def prepare(
        self, ctx: TaskContext, items: list[Any], request: OpenAIEmbeddingsRequest
    ) -> tuple[list[Row], None]:
        cut = ctx.truncating(request.truncate)
        rows = [
            ctx.encode_ids(t, truncate=cut)
            if isinstance(t, list)
            else row(ctx.encode(ctx.check_text(t), truncate=cut))
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
        if request.normalized is not None:
            normalize = request.normalized
        vectors = embeddings(results, normalize, request.dimensions)
        if request.base64:
            return [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        return vectors

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
        rows = text_rows(
            ctx, items, params.prompt_name, params.truncate, params.truncation_direction
        )
        return rows, None

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
