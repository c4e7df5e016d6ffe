"""What every task shares: the `Task` interface of the registry, the bundle's tokenizer, text
validation, truncation, the request's deadline, rows, and softmax."""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, WithJsonSchema
from tokenizers import Encoding, Tokenizer

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.bundle import BundleSpec, load_quantization_ranges, load_static_weights
from bertserve.runtime.errors import ClientGone, DeadlineExceeded, InvalidInput, TooLarge

# The limits that bound one request's items and the rows they become, named as the service's
# settings are (service/settings.py; tests/runtime/test_task_table.py holds them equal).
LimitName = Literal["max_client_batch", "max_request_rows", "max_rerank_documents"]
# Which end of an over-long input gives way (text-embeddings-inference's truncation_direction):
# "Left"/"Right" as TEI documents it, or in lower case, as huggingface_hub 2.4's
# InferenceClient.feature_extraction sends it; the schema lists all four.
LOWER_DIRECTIONS = {"left": "Left", "right": "Right"}
Direction = Annotated[
    Literal["Left", "Right"],
    BeforeValidator(lambda v: LOWER_DIRECTIONS.get(v, v) if isinstance(v, str) else v),
    WithJsonSchema({"type": "string", "enum": ["Left", "Right", "left", "right"]}),
]
# What happens to an input longer than the model's window (BERTSERVE_LONG_INPUT, or a
# request's `long_input`): refused (413), cut (TEI's --auto-truncate), or chunked
# (runtime/tasks/chunks.py).
LongInput = Literal["error", "truncate", "chunk"]


def unframed(ids: list[int], front: list[int], back: list[int]) -> list[int]:
    """`ids` without the single-text frame (`front` ... `back`: [CLS] ... [SEP]) where they
    begin and end with it, as a tokenizer returns them with its special tokens; else as sent."""
    if len(ids) < len(front) + len(back) or ids[: len(front)] != front:
        return ids
    if back and ids[len(ids) - len(back) :] != back:
        return ids
    return ids[len(front) : len(ids) - len(back)]


@dataclass(frozen=True)
class RequestLimits:
    max_client_batch: int = 2048
    max_request_rows: int = 256
    max_rerank_documents: int = 256

    def __getitem__(self, name: LimitName) -> int:
        return int(getattr(self, name))


# What a 422 for client-side token ids that are not the model's says to do.
FOREIGN = (
    "the ids look like another tokenizer's. Send the texts instead (langchain's "
    "OpenAIEmbeddings sends tiktoken ids unless check_embedding_ctx_length=False), or the ids "
    "of POST /tokenize: with its special tokens only at the ends, or with "
    "add_special_tokens set to false (the service puts the special tokens around them)"
)


class Task:
    """One endpoint of the registry (runtime/tasks/__init__.py): its request schema, how a
    request becomes rows for the model (`prepare`) and how the rows' outputs become the answer
    (`finish`, then `respond`). The handler, the HTTP adapters and evaluation call these and
    know nothing else of a task; a new task is a module with one subclass."""

    path: ClassVar[str]  # the HTTP path, e.g. "/classify"
    capability: ClassVar[str]  # the bundle task that serves it (bundle.json "tasks")
    reads: ClassVar[tuple[str, ...]]  # the graph outputs it needs
    request: ClassVar[type[BaseModel]]
    response: ClassVar[Any]  # the OpenAPI response model
    summary: ClassVar[str]
    example: ClassVar[dict[str, Any]]  # a first request (the ready line, the image test)
    # A model named in the body (OpenAI's "model") that serves nothing here falls back to the
    # default instead of a 404: clients send their provider's model names.
    lenient_model_name: ClassVar[bool] = False
    # The settings that bound a request's items and the rows they become (long texts' windows
    # multiply rows; a rerank's documents are a row each), and what its items are called.
    batch_limit: ClassVar[LimitName] = "max_client_batch"
    rows_limit: ClassVar[LimitName] = "max_request_rows"
    items_name: ClassVar[str] = "inputs"
    # Where the items are in the request body (properties, outermost first), and how many items
    # the request has besides that list (the OpenAPI document's maxItems: service.http.contract).
    items_field: ClassVar[tuple[str, ...]] = ("inputs",)
    items_besides: ClassVar[int] = 0
    # Clients (a part of their User-Agent) that read the answer to one bare input as the first
    # element of a list: they get the answer a one-item list would (service.handler).
    nests_single_for: ClassVar[tuple[bytes, ...]] = ()

    def model_name(self, request: Any) -> str | None:
        """A model the body asks for (`?model=` wins over it)."""
        return None

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        """Refuse (413/422) a request whose work or answer would pass a limit, from counts that
        cost nothing (characters, [MASK]s, top_k), before anything is tokenised; return the
        work's cost in characters of tokenising, its parameters' work counted in, which decides
        whether it runs off the event loop (`inline_cost`)."""
        return sum(len(t) for t in self.texts(items))

    def texts(self, items: list[Any]) -> list[str]:
        """The strings a request's items carry (for the cheap counts above)."""
        out: list[str] = []
        for item in items:
            fields = [item] if isinstance(item, str) else item.model_dump().values()
            out.extend(str(v) for v in fields)
        return out

    def inputs(self, request: Any) -> tuple[list[Any], bool]:
        """The request's items, and whether one was sent bare (answered bare)."""
        items = request.inputs
        single = not isinstance(items, list)
        return ([items] if single else list(items)), single

    def prepare(self, ctx: TaskContext, items: list[Any], request: Any) -> tuple[list[Row], Any]:
        """Rows for the model, and what `finish` needs besides their outputs."""
        raise NotImplementedError

    def needs(self, request: Any) -> tuple[str, ...]:
        """Capabilities this request needs of its model besides `capability` (a request for
        several heads of one bundle: runtime/tasks/encode.py)."""
        return ()

    def wanted(self, request: Any) -> tuple[str, ...]:
        """The outputs this request reads (`reads`, unless what it asks for decides)."""
        return self.reads

    def plan(self, ctx: TaskContext, items: list[Any], request: Any) -> tuple[list[Row], Any]:
        """`prepare`, with each row asking for the outputs the request reads that the bundle
        computes in head graphs of their own (bundle.json "heads": run only for the calls
        that ask). What the handler and evaluation call."""
        rows, prepared = self.prepare(ctx, items, request)
        heads = tuple(name for name in self.wanted(request) if name in ctx.spec.heads)
        if heads:
            for row in rows:
                row.wants = tuple(sorted({*row.wants, *heads}))
        return rows, prepared

    def finish(
        self, ctx: TaskContext, prepared: Any, results: list[RowResult], request: Any
    ) -> list[Any]:
        """One answer per item."""
        raise NotImplementedError

    def respond(
        self, answers: list[Any], single: bool, request: Any, rows: list[Row], model: str
    ) -> Any:
        """The response body."""
        return answers[0] if single else answers


@dataclass
class TaskContext:
    """A bundle as the tasks see it: its spec and two tokenizers. The plain one is only read,
    from any thread. The windowing one is configured per call (`tokenizers` keeps truncation
    settings on the object), and large requests are prepared on worker threads, so each thread
    has its own."""

    spec: BundleSpec
    tokenizer: Tokenizer
    tokenizer_json: str
    max_text_chars: int
    max_rows: int = 1_000_000  # sequences one request may become (windows are counted first)
    # Cut over-long inputs where a request does not say (`truncate` left out): the service's
    # `auto_truncate`, as text-embeddings-inference's --auto-truncate.
    auto_truncate: bool = False
    # What an over-long input gets where a request says nothing (BERTSERVE_LONG_INPUT:
    # runtime/tasks/chunks.py): "error" (413), "truncate" or "chunk".
    long_input: LongInput = "error"
    # The largest answer (BERTSERVE_MAX_RESPONSE_BYTES), for the tasks whose answer's size is
    # known only once the inputs are tokenised (/embed/chunks): refused before the model runs.
    max_response_bytes: int = 32_000_000
    _local: threading.local = field(default_factory=threading.local)
    _frame: tuple[list[int], list[int]] | None = field(default=None, repr=False)
    _foreign: frozenset[int] | None = field(default=None, repr=False)
    # An inference-free sparse side's weight a vocabulary id (runtime.bundle.load_static_weights)
    static_weights: np.ndarray | None = field(default=None, repr=False)
    # int8 / uint8 embeddings' ranges by width (runtime.bundle.load_quantization_ranges)
    ranges: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # A byte-level tokenizer (RoBERTa's BPE, or a byte-fallback model) may make several pieces
    # of one character: its bounds count UTF-8 bytes, not characters.
    byte_level: bool = False

    @classmethod
    def load(
        cls,
        directory: Path,
        spec: BundleSpec,
        max_text_chars: int,
        max_rows: int = 1_000_000,
        auto_truncate: bool = False,
        long_input: LongInput = "error",
        max_response_bytes: int = 32_000_000,
    ) -> TaskContext:
        text = (directory / spec.tokenizer.file).read_text(encoding="utf-8")
        plain = Tokenizer.from_str(text)
        plain.no_truncation()
        plain.no_padding()
        parsed = json.loads(text)
        byte_level = bool(parsed["model"].get("byte_fallback")) or '"ByteLevel"' in json.dumps(
            parsed.get("pre_tokenizer")
        )
        if long_input == "error" and auto_truncate:
            long_input = "truncate"
        ctx = cls(
            spec,
            plain,
            text,
            max_text_chars,
            max_rows,
            auto_truncate,
            long_input,
            max_response_bytes,
            byte_level=byte_level,
        )
        ctx.static_weights = load_static_weights(directory, spec)
        ctx.ranges = load_quantization_ranges(directory, spec)
        if "embed" in spec.tasks:  # token-id inputs are checked against it: made now, not on
            _ = ctx.foreign_ids  # the event loop when the first such request comes
        return ctx

    @property
    def windowing(self) -> Tokenizer:
        tok = getattr(self._local, "windowing", None)
        if tok is None:
            tok = self._local.windowing = Tokenizer.from_str(self.tokenizer_json)
            tok.no_padding()
        return tok

    @property
    def max_len(self) -> int:
        return self.spec.max_seq_len

    @property
    def max_word_chars(self) -> int | None:
        """The most pieces one word can become (WordPiece's max_input_chars_per_word: a longer
        word is one [UNK]); None for a model without that bound."""
        return getattr(self.tokenizer.model, "max_input_chars_per_word", None)

    def max_pieces(self, text: str) -> int:
        """An upper bound on the word pieces of `text`, cheaper than tokenising it: every piece
        covers at least one character (a byte-level tokenizer's: one byte) of the normalised
        text."""
        normalizer = self.tokenizer.normalizer
        normal = normalizer.normalize_str(text) if normalizer is not None else text
        return len(normal.encode("utf-8")) if self.byte_level else len(normal)

    def check_text(self, text: str, what: str = "input") -> str:
        if not text.strip():
            raise InvalidInput(f"{what} is empty")
        if len(text) > self.max_text_chars:
            raise TooLarge(
                f"{what} has {len(text):,} characters; the limit is {self.max_text_chars:,}"
            )
        return text

    def rows_for(self, inputs: int) -> int:
        """The sequences a request of `inputs` inputs may become: `max_rows`, or a row an input
        if that is more (the windows of long texts are what the bound is for)."""
        return max(self.max_rows, inputs)

    def truncating(self, asked: bool | None) -> bool:
        """Whether a request cuts over-long inputs: as it says, else as the service says."""
        return self.auto_truncate if asked is None else asked

    def encode(
        self,
        text: str,
        pair: str | None = None,
        truncate: bool = False,
        direction: Direction = "Right",
    ) -> Encoding:
        """Encode without cutting; an encoding longer than the model takes is a 413 unless the
        request asked to truncate (refused before tokenising when its words alone are too
        many). `direction`: which end gives way ("Left": the start, text-embeddings-inference's
        truncation_direction)."""
        if truncate:
            return self.truncated(text, pair, direction)
        if min_tokens(text) + min_tokens(pair or "") > self.max_len:
            raise self.too_long(min_tokens(text) + min_tokens(pair or ""), "at least ")
        enc = tokenize(self.tokenizer, text, pair)
        if len(enc) > self.max_len:
            raise self.too_long(len(enc.ids))
        return enc

    def truncated(
        self,
        text: str,
        pair: str | None,
        direction: Direction = "Right",
        first: Encoding | None = None,
    ) -> Encoding:
        """The encoding `tokenizers`' longest_first truncation gives, in time and memory linear
        in the texts. The library's own builds every overflow combination of a pair, which
        grows with the product of the lengths (8k characters a side: 16,509 encodings and
        +1.5 GB); here each side is encoded alone, the split is the library's, and each side
        is cut to its share before the pair template joins them. `first`: `text` already
        encoded without special tokens (a query paired with many documents, encoded once)."""
        tok = self.tokenizer
        if first is None:
            items = [text] if pair is None else [text, pair]
            sides = tok.encode_batch(items, add_special_tokens=False)
            first, second = sides[0], (sides[1] if pair is not None else None)
        else:
            second = None if pair is None else tokenize(tok, pair, add_special_tokens=False)
        budget = self.max_len - tok.num_special_tokens_to_add(pair is not None)
        keep_first, keep_second = longest_first(
            len(first), len(second) if second is not None else 0, budget
        )
        first = self.clipped(text, first, keep_first, direction)
        if second is not None and pair is not None:
            second = self.clipped(pair, second, keep_second, direction)
        return tok.post_process(first, second)

    def clipped(
        self, text: str, enc: Encoding, keep: int, direction: Direction = "Right"
    ) -> Encoding:
        """`enc` (of `text`) cut to its first `keep` pieces (`direction` "Left": its last). The
        text is cut after the word that holds the last piece kept (before the word that holds
        the first), so the pieces kept are those of the whole text, and encoded again:
        truncating the whole encoding would keep its rest as overflow."""
        if len(enc) <= keep:
            return enc
        if direction == "Left":
            start = len(enc) - keep
            word = enc.token_to_word(start)
            while word is not None and start > 0 and enc.token_to_word(start - 1) == word:
                start -= 1
            # From the end of the piece before: the white space before the first word kept is
            # part of its first piece in a byte-level BPE ("Ġword"), and goes nowhere else.
            before = enc.token_to_chars(start - 1) if start > 0 else None
            span = enc.token_to_chars(start)
            tail = text[before[1] :] if before else text[span[0] :] if span else text
            cut = tokenize(self.tokenizer, tail, add_special_tokens=False)
            cut.truncate(keep, direction="left")
            return cut
        end, word = keep, enc.token_to_word(keep - 1)
        while word is not None and end < len(enc) and enc.token_to_word(end) == word:
            end += 1
        span = enc.token_to_chars(end - 1)
        head = text[: span[1]] if span else text
        cut = tokenize(self.tokenizer, head, add_special_tokens=False)
        cut.truncate(keep)
        return cut

    def encode_ids(self, ids: list[int], truncate: bool = False) -> Row:
        """A row from token ids the client tokenised itself (OpenAI's token-array inputs, TEI's
        ids): ids as a tokenizer returns them with its special tokens (BERT's [CLS] ... [SEP],
        /tokenize's default) are used as they are; bare ids are put between the special tokens
        the tokenizer's single-text template puts around a text. Either way the row is the
        text's. An id outside the vocabulary, or one no text tokenises to, is a 422; an
        over-long input a 413 unless `truncate` (which keeps the frame)."""
        vocab = self.spec.tokenizer.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidInput(
                f"token id {bad} is outside the model's vocabulary (0..{vocab - 1}): {FOREIGN}"
            )
        front, back = self.special_frame
        ids = unframed(ids, front, back)
        foreign = self.foreign_ids  # the frame's ids not among them: a pair's [SEP], as sent
        odd = next((i for i in ids if i in foreign), None)
        if odd is not None:
            raise InvalidInput(
                f"token id {odd} ({self.tokenizer.id_to_token(odd)!r}) is one this model's "
                f"tokenizer never makes from text: {FOREIGN}"
            )
        room = self.max_len - len(front) - len(back)
        if len(ids) > room:
            if not truncate:
                raise self.too_long(len(ids) + len(front) + len(back))
            ids = ids[:room]
        full = np.asarray([*front, *ids, *back], dtype=np.int64)
        return Row(full, np.zeros_like(full))

    @property
    def foreign_ids(self) -> frozenset[int]:
        """Ids that tokenising a text never gives: the special tokens but the unknown one and
        the single-text frame (`special_frame`: [CLS] and [SEP], which a tokenizer adds) and,
        for a WordPiece vocabulary, the pieces whose own text tokenises to something else
        (BERT's [unused0]..[unused993] at ids 1-998). Client-side ids from another tokenizer
        land there: tiktoken's cl100k gives the commonest English words and punctuation ids
        below 1,000 (" the" 279, "." 13), so a sentence of them is told apart from WordPiece
        ids instead of embedded as nonsense. Computed once (~0.2 s; at load for an embedding
        bundle)."""
        found = self._foreign
        if found is None:
            tok = self.tokenizer
            model = tok.model
            # The unknown token, which text does give: WordPiece and BPE name it, a Unigram
            # model (SentencePiece) numbers it.
            described = json.loads(self.tokenizer_json)["model"]
            unknown = described.get("unk_id")
            if unknown is None and described.get("unk_token"):
                unknown = tok.token_to_id(described["unk_token"])
            decoder = tok.get_added_tokens_decoder()
            front, back = self.special_frame
            special = {i for i, t in decoder.items() if t.special} - {unknown, *front, *back}
            unreachable: set[int] = set()
            if type(model).__name__ == "WordPiece":
                prefix = model.continuing_subword_prefix
                pieces = [
                    (i, p)
                    for p, i in tok.get_vocab(with_added_tokens=False).items()
                    if not p.startswith(prefix)
                ]
                encoded = tok.encode_batch([p for _, p in pieces], add_special_tokens=False)
                unreachable = {i for (i, _), e in zip(pieces, encoded, strict=True) if e.ids != [i]}
            found = self._foreign = frozenset(special | unreachable)
        return found

    @property
    def special_frame(self) -> tuple[list[int], list[int]]:
        """The special tokens before and after a single text ([CLS] and [SEP] for BERT)."""
        frame = self._frame
        if frame is None:
            enc = self.tokenizer.encode("a")
            first = enc.sequence_ids.index(0)
            last = len(enc.sequence_ids) - enc.sequence_ids[::-1].index(0)
            frame = self._frame = (enc.ids[:first], enc.ids[last:])
        return frame

    def too_long(self, tokens: int, qualifier: str = "") -> TooLarge:
        """The 413 of an input over the window, with the ways out in the syntax of the route
        that is answering (`ROUTE`, set by the service's handler)."""
        ways = WAYS_OUT.get(ROUTE.get())
        if ways is None:
            out = (
                'ask for truncation ("parameters": {"truncation": true}; "truncate": true on '
                '/embed, /similarity and /rerank), or for chunks ("long_input": "chunk"; in '
                '"parameters" on /classify and /similarity)'
            )
        else:
            truncate, chunk = ways
            out = f"ask for truncation ({truncate})" + (
                f" or for chunks ({chunk})" if chunk else ""
            )
        return TooLarge(
            f"input is {qualifier}{tokens} tokens; the model takes {self.max_len}. "
            f"Shorten it, {out}"
        )


def tokenize(
    tok: Tokenizer, text: str, pair: str | None = None, add_special_tokens: bool = True
) -> Encoding:
    """One encoding. A long text goes through `encode_batch`, which lets the GIL go for the
    whole call: a worker thread's `encode` of a 100k-character text was seen to hold it for
    100-150 ms (scripted beside a 1 ms ticker), and the event loop with it."""
    if len(text) + len(pair or "") < 2048:
        return tok.encode(text, pair, add_special_tokens=add_special_tokens)
    item = text if pair is None else (text, pair)
    return tok.encode_batch([item], add_special_tokens=add_special_tokens)[0]


def longest_first(first: int, second: int, budget: int) -> tuple[int, int]:
    """How many pieces of each side `tokenizers`' longest_first truncation keeps: all, if they
    fit; else the shorter side whole and the longer cut to the rest; else half each, the longer
    side (the second, if equal) taking the odd piece."""
    if first + second <= budget:
        return first, second
    short, long_ = sorted((first, second))
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short, long_ = budget // 2, budget // 2 + budget % 2
    return (long_, short) if first > second else (short, long_)


# The route answering the request (its task's path), set by the service's handler: what a 413
# for an over-long input names as the way out (TaskContext.too_long).
ROUTE: contextvars.ContextVar[str | None] = contextvars.ContextVar("route", default=None)
_PARAMETERS_TRUNCATION = '"parameters": {"truncation": true}'
WAYS_OUT: dict[str | None, tuple[str, str | None]] = {
    "/classify": (_PARAMETERS_TRUNCATION, '"parameters": {"long_input": "chunk"}'),
    "/fill-mask": (_PARAMETERS_TRUNCATION, None),
    "/nsp": (_PARAMETERS_TRUNCATION, None),
    "/embed": ('"truncate": true', '"long_input": "chunk"'),
    "/v1/embeddings": ('"truncate": true', '"long_input": "chunk"'),
    "/similarity": ('"parameters": {"truncate": true}', '"parameters": {"long_input": "chunk"}'),
    "/rerank": ('"truncate": true', '"long_input": "chunk"'),
    "/embed_sparse": ('"truncate": true', '"long_input": "chunk"'),
    "/v2/embed": ('"truncate": "END"', None),
}
# The running request's check (`checkpoint`): set by the handler, copied into the worker thread
# that prepares or finishes a large request, absent in evaluation.
_CHECK: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "bertserve_request_check", default=None
)


def deadline_check(deadline: float, gone: Callable[[], bool]) -> Callable[[], None]:
    """A check that raises once `deadline` (time.monotonic) has passed or `gone()` says the
    client left: 504 or 499, and the request's work stops there."""

    def check() -> None:
        if gone():
            raise ClientGone("client closed the connection")
        if time.monotonic() > deadline:
            raise DeadlineExceeded(
                "the request ran past its deadline (its X-Request-Timeout-Ms, else "
                "request_timeout_s)"
            )

    return check


def watch(check: Callable[[], None] | None) -> contextvars.Token:
    """Make `check` the current request's; `unwatch` the token it returns when it is done."""
    return _CHECK.set(check)


def unwatch(token: contextvars.Token) -> None:
    _CHECK.reset(token)


def checkpoint() -> None:
    """Stop here if the current request's client left or its deadline passed. Called between
    items and windows of the long loops, so no step runs on for a request nobody awaits."""
    check = _CHECK.get()
    if check is not None:
        check()


def min_tokens(text: str) -> int:
    """A lower bound on a text's word pieces, for free: every white-space separated word is at
    least one piece. A request refused on it would have been refused after tokenising too."""
    return len(text.split())


def windows_needed(tokens: int, window: int, advance: int) -> int:
    """Windows of `window` tokens, each `advance` tokens after the last, to cover `tokens`."""
    if tokens <= window:
        return 1
    return 1 + -(-(tokens - window) // max(1, advance))


def usage(rows: list[Row]) -> dict[str, int]:
    """OpenAI's, Cohere's and Jina's token count of a request: every row's tokens."""
    tokens = sum(len(r) for r in rows)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def row(enc: Encoding, mask_positions: np.ndarray | None = None) -> Row:
    return Row(
        np.asarray(enc.ids, dtype=np.int64),
        np.asarray(enc.type_ids, dtype=np.int64),
        mask_positions,
    )


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def top_k_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` largest of `values` (1-D, finite), largest first, equal values in index
    order: the first k of a stable descending sort. A full sort of a 30,522-word vocabulary took
    2.7 ms a [MASK]; k passes of argmax take about 5 us each, so they serve the usual small k."""
    k = min(k, len(values))
    if k > 16:
        return np.argsort(-values, kind="stable")[:k]
    rest = values.astype(np.float64)  # a copy, and -inf below everything it holds
    out = np.empty(k, dtype=np.int64)
    for i in range(k):
        out[i] = np.argmax(rest)  # the first of equal maxima: a stable sort's order
        rest[out[i]] = -np.inf
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
