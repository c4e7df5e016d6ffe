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
against float64 digits' 21, written 2.5x faster. Or quantised, where a request's
`embedding_type` asks (an extension on /embed; Jina's field on /v1/embeddings):
runtime/tasks/quantize.py.
"""

from __future__ import annotations

import base64
import bisect
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import (
    CLOSED,
    PRIORITY_TEXT,
    STRICT,
    WHOLE,
    Params,
    Priority,
    Request,
    Text,
)
from bertserve.runtime.tasks.chunks import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    MEAN_OVERLAP_TOKENS,
    Chunk,
    Document,
    Groups,
    LongInput,
    check_chunk_tokens,
    chunk_rows,
    documents,
    id_chunks,
    late_windows,
    long_mode,
    prompt_pieces,
    room,
    too_many,
    weighted_mean,
    window_for,
)
from bertserve.runtime.tasks.common import (
    Direction,
    Task,
    TaskContext,
    checkpoint,
    row,
    tokenize,
    usage,
)
from bertserve.runtime.tasks.quantize import VALUE_BYTES, Precision, check_precision, quantize

Texts = Text | Annotated[list[Text], Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]
PromptName = Annotated[
    str | None,
    Field(
        description="a prompt the bundle declares (GET /models: prompts), put before each input; "
        "default: the bundle's default prompt, if it has one"
    ),
]


LongInputField = Annotated[
    LongInput | None,
    Field(
        description="an input longer than the model's window: error (413), truncate, or chunk "
        "(cut into chunks of the window whose answers are combined: "
        "docs/api.md#long-inputs); left out: as `truncate` says, else the service's "
        "BERTSERVE_LONG_INPUT (default error)"
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


EmbeddingType = Annotated[
    Precision,
    Field(
        description="(an extension) float, or quantised: int8 / uint8 (the bundle's calibrated "
        "ranges, unit vectors), binary / ubinary (a bit a component, packed eight to a byte): "
        "sentence-transformers' quantize_embeddings"
    ),
]


class EmbedRequest(Request):
    inputs: Texts
    normalize: bool = True
    long_input: LongInputField = None
    truncate: Truncate = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: PromptName = None
    dimensions: Dimensions = None
    embedding_type: EmbeddingType = "float"


class OpenAIEmbeddingsRequest(Request):
    model_config = CLOSED  # OpenAI refuses fields it does not know; so does this route

    input: Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)] = Field(
        description="a text, a list of texts, or token ids of the model's own tokenizer (one "
        "list of ids, or a list of them): ids with the tokenizer's special tokens at both ends are "
        "used as they are, bare ids are put between them"
    )
    model: str | None = Field(
        None, description="an embedding bundle's name; other names get the default model"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions = None
    user: str | None = Field(None, description="accepted and ignored")
    priority: Priority = Field(
        None, description=PRIORITY_TEXT
    )  # vLLM's field: OpenAI's API has no such field
    truncate: Truncate = None  # an extension: OpenAI's API has no such field
    long_input: LongInputField = None  # an extension too
    # Jina's embeddings API: the same route with more fields (langchain's JinaEmbeddings).
    normalized: bool | None = Field(
        None, description="(Jina) unit-length vectors; default: as the bundle pools"
    )
    embedding_type: Literal["float", "base64", "binary", "ubinary", "int8", "uint8"] | None = Field(
        None,
        description="(Jina) float or base64 as encoding_format, binary / ubinary packed bits; "
        "(an extension) int8 / uint8 with the bundle's calibrated ranges",
    )
    task: str | None = Field(None, description="(Jina) accepted and ignored")
    late_chunking: bool | None = Field(
        None,
        description="(Jina) the inputs are the chunks of one text, in order: each one's vector "
        "is pooled from token states computed with the others around it",
    )

    @property
    def base64(self) -> bool:
        """Vectors as base64 of little-endian float32 (OpenAI's `encoding_format`, Jina's
        `embedding_type`)."""
        return (self.embedding_type or self.encoding_format) == "base64"

    @property
    def precision(self) -> Precision:
        """The vectors' type besides float32 and its base64: a quantised one, or "float"."""
        kind = self.embedding_type
        return "float" if kind is None or kind == "base64" else kind


class SimilarityInputs(BaseModel):
    model_config = STRICT
    source_sentence: Text
    sentences: Annotated[list[Text], Field(min_length=1)]


class SimilarityParams(Params):
    long_input: LongInputField = None
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
    of JSON (-1.2345678e-38,), or 4 bytes as base64's 16/3 characters (quantize.VALUE_BYTES)."""
    width = dimensions or ctx.spec.architecture.hidden_size
    return vectors * (width * VALUE_BYTES["base64" if base64 else "float"] + 64)


def check_answer(
    ctx: TaskContext,
    vectors: int,
    dimensions: int | None,
    base64: bool,
    limits: Any,
    remedy: str = "Send fewer inputs a request",
    text_bytes: int = 0,
) -> None:
    """Refuse, before any work, a request whose answer would pass max_response_bytes;
    `text_bytes`: what the answer carries besides its vectors (chunks' texts)."""
    size = answer_bytes(ctx, vectors, dimensions, base64) + text_bytes
    most = limits.max_response_bytes
    if size > most:
        texts = f" and {text_bytes:,} bytes of text" if text_bytes else ""
        raise TooLarge(
            f"{vectors:,} vectors of {dimensions or ctx.spec.architecture.hidden_size} "
            f"components{texts} may take {size:,} bytes; the answer limit is {most:,} "
            f"(BERTSERVE_MAX_RESPONSE_BYTES). {remedy}, or ask for fewer dimensions"
        )


def chunk_text_bytes(doc: Document) -> int:
    """At most how many bytes a document's chunks' texts take as JSON strings: each
    character's UTF-8 bytes, 6 for one JSON escapes (a quote, a backslash, a control
    character), summed over each chunk from prefix sums (overlapping chunks repeat text)."""
    points = np.frombuffer(doc.text.encode("utf-32-le"), dtype=np.uint32)
    sizes = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    sizes[(points < 0x20) | (points == 0x22) | (points == 0x5C)] = 6
    ends = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    return int(sum(ends[c.end] - ends[c.start] + 10 for c in doc.chunks))


def text_rows(
    ctx: TaskContext,
    texts: list[str],
    prompt_name: str | None,
    long_input: LongInput,
    direction: Direction = "Right",
) -> tuple[list[Row], Groups]:
    """A row a text, behind its prompt (`prompted`); with `long_input` "chunk" a row a chunk of
    an over-long text (chunks of the window less the prompt, overlapping by
    MEAN_OVERLAP_TOKENS), and which rows are whose."""
    if long_input != "chunk":
        cut = long_input == "truncate"
        rows = [
            row(
                ctx.encode(
                    prompted(ctx, prompt_name, ctx.check_text(t)), truncate=cut, direction=direction
                )
            )
            for t in texts
        ]
        return rows, Groups.one_each(len(rows))
    prompt = prompted(ctx, prompt_name, "")
    size = room(ctx, len(prompt_pieces(ctx, prompt)))
    overlap = MEAN_OVERLAP_TOKENS
    return chunk_rows(ctx, texts, size, overlap, lambda t: ctx.encode(prompt + t, truncate=True))


def combined(
    results: list[RowResult], groups: Groups, normalize: bool, dimensions: int | None = None
) -> list[np.ndarray]:
    """Each input's vector: its row's (`embeddings`), or for a chunked input the mean of its
    chunks' unit vectors weighted by their pieces, of unit length if `normalize`."""
    out = []
    for span, weights in zip(groups.spans, groups.weights, strict=True):
        if len(span) == 1:
            out.extend(embeddings([results[span.start]], normalize, dimensions))
            continue
        units = embeddings([results[i] for i in span], True, dimensions)
        mean = weighted_mean(units, weights).astype(np.float32)
        if normalize:
            mean = mean / max(float(np.linalg.norm(mean)), 1e-12)
        out.append(mean)
    return out


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
        check_precision(ctx, [request.embedding_type], request.dimensions, request.normalize)
        check_answer(ctx, len(items), request.dimensions, False, limits)
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: EmbedRequest
    ) -> tuple[list[Row], Groups]:
        mode = long_mode(ctx, request.long_input, request.truncate)
        return text_rows(ctx, items, request.prompt_name, mode, request.truncation_direction)

    def finish(
        self, ctx: TaskContext, prepared: Groups, results: list[RowResult], request: EmbedRequest
    ) -> list[Any]:
        vectors = combined(results, prepared, request.normalize, request.dimensions)
        return [quantize(v, request.embedding_type, ctx.ranges) for v in vectors]

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
        check_precision(ctx, [request.precision], request.dimensions, normalized(ctx, request))
        check_answer(ctx, len(items), request.dimensions, request.base64, limits)
        return sum(len(t) for t in items)  # characters, or ids (about as costly to encode)

    def prepare(
        self, ctx: TaskContext, items: list[Any], request: OpenAIEmbeddingsRequest
    ) -> tuple[list[Row], Groups | list[tuple[int, int, int]]]:
        mode = long_mode(ctx, request.long_input, request.truncate)
        if request.late_chunking and not isinstance(items[0], list):
            check_late(ctx)
            return late_inputs(ctx, items)
        if not isinstance(items[0], list):  # texts
            return text_rows(ctx, items, None, mode)
        if mode != "chunk":
            whole = [ctx.encode_ids(t, truncate=mode == "truncate") for t in items]
            return whole, Groups.one_each(len(whole))
        size = room(ctx)  # a client's ids: chunked where any piece ends, no text to look at
        overlap = MEAN_OVERLAP_TOKENS
        rows: list[Row] = []
        spans, weights = [], []
        for ids in items:
            chunks = id_chunks(len(ids), size, overlap)
            spans.append(range(len(rows), len(rows) + len(chunks)))
            weights.append([c.tokens for c in chunks])
            rows.extend(ctx.encode_ids(ids[c.first : c.last]) for c in chunks)
        return rows, Groups(spans, weights)

    def finish(
        self,
        ctx: TaskContext,
        prepared: Groups | list[tuple[int, int, int]],
        results: list[RowResult],
        request: OpenAIEmbeddingsRequest,
    ) -> list[Any]:
        normalize = normalized(ctx, request)
        if isinstance(prepared, list):  # late chunking's places
            vectors = late_vectors(results, prepared, normalize, request.dimensions)
        else:
            vectors = combined(results, prepared, normalize, request.dimensions)
        if request.base64:
            return [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        return [quantize(v, request.precision, ctx.ranges) for v in vectors]

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


def normalized(ctx: TaskContext, request: OpenAIEmbeddingsRequest) -> bool:
    """Whether /v1/embeddings answers unit vectors: Jina's `normalized`, else as the bundle
    pools."""
    if request.normalized is not None:
        return request.normalized
    return ctx.spec.pooling.normalize if ctx.spec.pooling else True


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
    ) -> tuple[list[Row], Groups]:
        params = request.parameters
        mode = long_mode(ctx, params.long_input, params.truncate)
        return text_rows(ctx, items, params.prompt_name, mode, params.truncation_direction)

    def finish(
        self, ctx: TaskContext, prepared: Groups, results: list[RowResult], request: Any
    ) -> list[Any]:
        source, *others = combined(results, prepared, normalize=True)
        return [float(source @ other) for other in others]

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers


def check_late(ctx: TaskContext) -> None:
    """Late chunking mean-pools token states: a 422 for a bundle without them or one that pools
    otherwise."""
    if "token_embeddings" not in ctx.spec.outputs:
        raise InvalidInput(
            f"late chunking needs the token states of model {ctx.spec.name}, whose graph was "
            "exported without them: export it again with this version (bertserve export "
            "--task embed)"
        )
    if ctx.spec.pooling is not None and ctx.spec.pooling.mode != "mean":
        raise InvalidInput(
            f"late chunking mean-pools each chunk's token states; model {ctx.spec.name} pools "
            f"by {ctx.spec.pooling.mode}"
        )


def late_rows(
    ctx: TaskContext,
    ids: list[int],
    chunks: list[Chunk],
    prefix: list[int],
    longest: int,
    rows: list[Row],
) -> list[tuple[int, int, int]]:
    """Late chunking's rows for one text of pieces `ids`: windows of the model's full length
    (behind the prompt's pieces `prefix`) that hold each chunk of at most `longest` pieces
    whole, appended to `rows`, with their token states asked for. Returns where each chunk's
    states are: (row index, first position, one past its last)."""
    front, back = ctx.special_frame
    window = room(ctx, len(prefix))
    head = len(front) + len(prefix)
    starts = late_windows(len(ids), window, longest, chunks)
    first_row = len(rows)
    for s in starts:
        full = np.asarray([*front, *prefix, *ids[s : s + window], *back], dtype=np.int64)
        rows.append(Row(full, np.zeros_like(full), wants=("token_embeddings",)))
    places = []
    for chunk in chunks:
        w = window_for(chunk, starts, window)
        s = starts[w]
        places.append((first_row + w, head + chunk.first - s, head + chunk.last - s))
    return places


def late_vectors(
    results: list[RowResult],
    places: list[tuple[int, int, int]],
    normalize: bool,
    dimensions: int | None,
) -> list[np.ndarray]:
    """Each chunk's vector: the mean of its pieces' token states (`late_rows`' places), its
    first `dimensions` components, of unit length if `normalize`. A chunk of no pieces (a text
    the tokenizer keeps nothing of) takes its window's pooled vector."""
    vectors = []
    for r, first, last in places:
        outputs = results[r].outputs
        vector = (
            outputs["token_embeddings"][first:last].astype(np.float32).mean(0)
            if last > first
            else outputs["embeddings"].astype(np.float32)
        )[:dimensions]
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        vectors.append(vector)
    return vectors


def late_inputs(ctx: TaskContext, texts: list[str]) -> tuple[list[Row], list[tuple[int, int, int]]]:
    """Jina's `late_chunking`: the inputs are the chunks of one text, read in order, joined by
    a space; each input's vector is the mean of its pieces' token states with the others
    around it (in windows of the model's full length where they are more than one)."""
    for i, t in enumerate(texts):
        ctx.check_text(t, f"input {i}")
    joined = " ".join(texts)
    if len(joined) > ctx.max_text_chars:
        raise TooLarge(
            f"late_chunking joins the inputs into one text of {len(joined):,} characters; the "
            f"limit is {ctx.max_text_chars:,}"
        )
    enc = tokenize(ctx.tokenizer, joined, add_special_tokens=False)
    starts = [piece[0] for piece in enc.offsets]
    chunks, at = [], 0
    for text in texts:
        first = bisect.bisect_left(starts, at)
        last = bisect.bisect_left(starts, at + len(text))
        chunks.append(Chunk(first, last, at, at + len(text)))
        at += len(text) + 1
    longest = max(c.tokens for c in chunks)
    if longest > room(ctx):
        raise TooLarge(
            f"with late_chunking an input is {longest} tokens; one must fit the model's window "
            f"({room(ctx)} besides its special tokens)"
        )
    windows = len(late_windows(len(enc), room(ctx), longest, chunks))
    if windows > ctx.rows_for(len(texts)):
        raise too_many(windows, ctx.rows_for(len(texts)), ctx.max_len)
    rows: list[Row] = []
    places = late_rows(ctx, enc.ids, chunks, [], longest, rows)
    return rows, places


class EmbedChunksRequest(Request):
    inputs: Texts
    chunk_tokens: Annotated[int, Field(ge=8), WHOLE] = Field(
        DEFAULT_CHUNK_TOKENS,
        description="the most pieces of the text a chunk holds (its own: special tokens and the "
        "prompt not counted); at most the model's window less those, which the default "
        "becomes where it is less",
    )
    overlap_tokens: Annotated[int, Field(ge=0), WHOLE] = Field(
        DEFAULT_OVERLAP_TOKENS,
        description="the most pieces two neighbouring chunks share: at most chunk_tokens - 1, "
        "which a larger value means (chunks then advance a word at a time)",
    )
    late: bool = Field(
        False,
        description="late chunking: each chunk's vector is the mean of its pieces' token states "
        "in a window of the model's full length around it, not of the chunk encoded alone",
    )
    normalize: bool = True
    prompt_name: PromptName = None
    dimensions: Dimensions = None
    return_text: bool = Field(False, description="each chunk's text beside its offsets")


class ChunkEmbedding(BaseModel):
    start: int = Field(description="the chunk's first character (Unicode code points)")
    end: int = Field(description="one past its last character")
    tokens: int = Field(description="its pieces (special tokens and the prompt not counted)")
    embedding: list[float]
    text: str | None = None


@dataclass
class ChunkPlan:
    """What /embed/chunks' finish needs: each input's chunks, which rows are whose, and for late
    chunking where each chunk's pieces sit in which row."""

    docs: list[Document]
    groups: Groups  # input i's rows
    # late: for input i, chunk j: (row index, first position, last position) of its states
    late: list[list[tuple[int, int, int]]] | None = None


class EmbedChunks(Task):
    path = "/embed/chunks"
    capability = "embed"
    reads = ("embeddings",)
    request = EmbedChunksRequest
    response = list[list[ChunkEmbedding]]
    summary = "Long documents cut into chunks, each with its character offsets and its vector"
    example: ClassVar[dict[str, Any]] = {
        "inputs": "Paris is the capital of France. It is known for the Eiffel Tower."
    }

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        check_dimensions(ctx, request.dimensions)
        if request.late:
            check_late(ctx)
        return super().check_cost(ctx, items, request, limits)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: EmbedChunksRequest
    ) -> tuple[list[Row], ChunkPlan]:
        prompt = prompted(ctx, request.prompt_name, "")
        prefix = prompt_pieces(ctx, prompt)
        # Overlap is "at most": from chunk_tokens on it is the most a chunk can share, so every
        # body the schema allows is served (the schema cannot compare two fields).
        window = room(ctx, len(prefix))
        size = request.chunk_tokens
        if "chunk_tokens" not in request.model_fields_set:  # the default, where it fits
            size = min(size, window)
        overlap = min(request.overlap_tokens, size - 1)
        check_chunk_tokens(ctx, size, len(prefix))
        late_room = window if request.late else None
        docs = documents(ctx, items, size, overlap, late_room=late_room)
        # A chunk a vector (and with return_text its text): the answer's size is known now,
        # before the model runs.
        remedy = "Send fewer or shorter inputs a request, larger chunk_tokens or less overlap"
        texts = sum(chunk_text_bytes(d) for d in docs) if request.return_text else 0
        count = sum(len(d.chunks) for d in docs)
        check_answer(ctx, count, request.dimensions, False, ctx, remedy, texts)
        if not request.late:
            rows: list[Row] = []
            spans = []
            for doc in docs:
                checkpoint()
                start = len(rows)
                rows.extend(
                    row(ctx.encode(prompt + doc.text[c.start : c.end], truncate=True))
                    for c in doc.chunks
                )
                spans.append(range(start, len(rows)))
            weights = [[c.tokens for c in d.chunks] for d in docs]
            return rows, ChunkPlan(docs, Groups(spans, weights))
        rows, spans, late = [], [], []
        for doc in docs:
            checkpoint()
            start = len(rows)
            late.append(late_rows(ctx, doc.encoding.ids, doc.chunks, prefix, size, rows))
            spans.append(range(start, len(rows)))
        weights = [[c.tokens for c in d.chunks] for d in docs]
        return rows, ChunkPlan(docs, Groups(spans, weights), late)

    def finish(
        self,
        ctx: TaskContext,
        prepared: ChunkPlan,
        results: list[RowResult],
        request: EmbedChunksRequest,
    ) -> list[Any]:
        out = []
        for i, doc in enumerate(prepared.docs):
            checkpoint()
            if prepared.late is None:
                span = prepared.groups.spans[i]
                vectors = embeddings(
                    [results[r] for r in span], request.normalize, request.dimensions
                )
            else:
                vectors = late_vectors(
                    results, prepared.late[i], request.normalize, request.dimensions
                )
            out.append(
                [
                    {"start": c.start, "end": c.end, "tokens": c.tokens, "embedding": v}
                    | ({"text": doc.text[c.start : c.end]} if request.return_text else {})
                    for c, v in zip(doc.chunks, vectors, strict=True)
                ]
            )
        return out

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        return answers  # a list an input, also for one input (as /embed answers)


EMBED = Embed()
EMBED_CHUNKS = EmbedChunks()
OPENAI_EMBEDDINGS = OpenAIEmbeddings()
SIMILARITY = Similarity()
