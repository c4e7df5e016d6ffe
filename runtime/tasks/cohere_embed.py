"""`POST /v2/embed` in Cohere's schema (API v2, `cohere.ClientV2.embed`), on bundles exported
with the `embed` task: several vector types of the same texts from one pass.

- `texts`: the inputs (Cohere's `images` and multimodal `inputs` are refused: text only).
- `input_type`: `search_query` and `search_document` put the bundle's "query" and
  "document" (or "passage") prompts before each text, `classification` and `clustering`
  prompts of those names, where the bundle declares them (else its default prompt, if any).
- `embedding_types`: any of float, int8, uint8, binary, ubinary, base64 (default float),
  each answered under its name; the quantised ones as runtime/tasks/quantize.py computes them.
- `output_dimension`: the first components, normalised again (Matryoshka), as /embed's
  `dimensions`.
- `truncate`: END (the default, as Cohere's) cuts an over-long text's end, START its start,
  NONE refuses it (413). `max_tokens` cuts each text to at most that many word pieces first,
  from the same end, at a word boundary (the pieces kept are those the whole text has there);
  with NONE a text over it is a 413.
The vectors are unit vectors (Cohere's are); `priority` orders the queue (runtime.batching).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import TooLarge
from bertserve.runtime.schemas import PRIORITY_TEXT, WHOLE, Priority, Request, Text
from bertserve.runtime.tasks.chunks import Groups
from bertserve.runtime.tasks.common import (
    Direction,
    LongInput,
    Task,
    TaskContext,
    tokenize,
    usage,
)
from bertserve.runtime.tasks.embed import check_dimensions, combined, text_rows
from bertserve.runtime.tasks.quantize import VALUE_BYTES, check_precision, quantize, values

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
# Cohere's "image" is not among them: this service embeds texts (a 422 lists these).
InputType = Literal["search_document", "search_query", "classification", "clustering"]
# The bundle prompts each input_type may name, first declared wins.
PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("query", "search_query"),
    "search_document": ("document", "passage", "search_document"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


def text_only(value: Any) -> Any:
    if value is not None:
        raise ValueError("this service embeds text: send the texts in `texts`")
    return value


NotServed = Annotated[None, BeforeValidator(text_only)]


class CohereEmbedRequest(Request):
    texts: Annotated[list[Text], Field(min_length=1)] = Field(
        description="the texts; at most BERTSERVE_MAX_CLIENT_BATCH"
    )
    model: str | None = Field(
        None, description="an embedding bundle's name; other names get the default model"
    )
    input_type: InputType | None = Field(
        None, description="search_query / search_document (the bundle's prompts), and the like"
    )
    embedding_types: Annotated[list[EmbeddingType], Field(min_length=1)] = Field(
        default_factory=lambda: list[EmbeddingType](["float"]),
        description="float, int8, uint8, binary, ubinary, base64: each answered under its name",
    )
    output_dimension: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="keep the first components, then normalise; at most the model's width"
    )
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="cut each text to this many word pieces (from the end truncate says)"
    )
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: Priority = Field(None, description=PRIORITY_TEXT)
    images: NotServed = Field(None, description="not served: text only")
    inputs: NotServed = Field(None, description="not served: send `texts`")


class EmbedByType(BaseModel):
    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereEmbedResponse(BaseModel):
    id: str
    embeddings: EmbedByType
    texts: list[str]
    meta: dict[str, Any]
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


def prompt_for(ctx: TaskContext, input_type: str | None) -> str | None:
    """The bundle prompt an input_type names, if it declares one."""
    for name in PROMPTS.get(input_type or "", ()):
        if name in ctx.spec.prompts:
            return name
    return None


def cut_tokens(ctx: TaskContext, text: str, most: int, from_start: bool | None) -> str:
    """`text` cut to at most `most` word pieces, at a word boundary so that what is kept
    tokenises to the pieces the whole text has there: its first, or with `from_start` its
    last (the white space before the first word kept stays: byte-level BPE reads it). With
    `from_start` None (truncate NONE), a text over `most` is a 413. A word of more than `most`
    pieces at the edge is cut between its pieces."""
    enc = tokenize(ctx.tokenizer, text, add_special_tokens=False)
    n = len(enc)
    if n <= most:
        return text
    if from_start is None:
        raise TooLarge(
            f"a text of {n} word pieces is over max_tokens {most}, and truncate is NONE: send "
            '"truncate": "END" or "START" to cut it'
        )
    words, offsets = enc.word_ids, enc.offsets
    if from_start:
        first = n - most  # the first piece kept: moved on to a word's first piece
        while 0 < first < n and words[first] == words[first - 1]:
            first += 1
        first = first if first < n else n - most
        return text[offsets[first - 1][1] :] if first > 0 else text
    end = most  # pieces [0, end) kept: moved back to a word's end
    while end > 0 and words[end] == words[end - 1]:
        end -= 1
    end = end or most
    return text[: offsets[end - 1][1]]


class CohereEmbed(Task):
    path = "/v2/embed"
    capability = "embed"
    reads = ("embeddings",)
    request = CohereEmbedRequest
    response = CohereEmbedResponse
    summary = "Embeddings in Cohere's v2 schema: float, int8, uint8, binary, base64 at once"
    example: ClassVar[dict[str, Any]] = {
        "texts": ["Where was Aristotle born?"],
        "model": "embed-v4.0",
        "input_type": "search_query",
        "embedding_types": ["float", "int8"],
    }
    lenient_model_name = True
    items_name = "texts"
    items_field = ("texts",)

    def model_name(self, request: CohereEmbedRequest) -> str | None:
        return request.model

    def inputs(self, request: CohereEmbedRequest) -> tuple[list[Any], bool]:
        return list(request.texts), False

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        check_dimensions(ctx, request.output_dimension)
        kinds = [k for k in request.embedding_types if k != "base64"]
        check_precision(ctx, kinds, request.output_dimension, True)
        width = request.output_dimension or ctx.spec.architecture.hidden_size
        size = len(items) * sum(
            values(kind, width) * VALUE_BYTES[kind] + 8 for kind in set(request.embedding_types)
        )
        size += len(json.dumps(items, ensure_ascii=False).encode())  # the texts, echoed
        if size > limits.max_response_bytes:
            raise TooLarge(
                f"{len(items):,} texts as {', '.join(sorted(set(request.embedding_types)))} "
                f"may take {size:,} bytes; the answer limit is {limits.max_response_bytes:,} "
                "(BERTSERVE_MAX_RESPONSE_BYTES). Send fewer texts a request, fewer "
                "embedding_types, or a smaller output_dimension"
            )
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: CohereEmbedRequest
    ) -> tuple[list[Row], Groups]:
        from_start = request.truncate == "START"
        if request.max_tokens is not None:
            side = None if request.truncate == "NONE" else from_start
            items = [cut_tokens(ctx, ctx.check_text(t), request.max_tokens, side) for t in items]
        mode: LongInput = "error" if request.truncate == "NONE" else "truncate"
        direction: Direction = "Left" if from_start else "Right"
        prompt = prompt_for(ctx, request.input_type)
        return text_rows(ctx, items, prompt, mode, direction)

    def finish(
        self,
        ctx: TaskContext,
        prepared: Groups,
        results: list[RowResult],
        request: CohereEmbedRequest,
    ) -> list[Any]:
        import base64

        vectors = combined(results, prepared, True, request.output_dimension)
        kinds = dict.fromkeys(request.embedding_types)  # each once, in the order asked
        return [
            {
                kind: base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                if kind == "base64"
                else quantize(v, kind, ctx.ranges)
                for kind in kinds
            }
            for v in vectors
        ]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        counted = usage(rows)
        kinds = dict.fromkeys(request.embedding_types)
        return {
            "id": str(uuid.uuid4()),
            "embeddings": {kind: [a[kind] for a in answers] for kind in kinds},
            "texts": list(request.texts),
            "meta": {
                "api_version": {"version": "2"},
                "billed_units": {"input_tokens": counted["prompt_tokens"]},
                "model": model,
            },
            "response_type": "embeddings_by_type",
        }


COHERE_EMBED = CohereEmbed()
