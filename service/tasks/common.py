"""What every task shares: the `Task` interface of the registry, the bundle's tokenizer, text
validation, rows, and softmax."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel
from tokenizers import Encoding, Tokenizer

from service.batching import Row, RowResult
from service.bundle import BundleSpec
from service.errors import InvalidInput, TooLarge


class Task:
    """One endpoint of the registry (service/tasks/__init__.py): its request schema, how a
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

    def model_name(self, request: Any) -> str | None:
        """A model the body asks for (`?model=` wins over it)."""
        return None

    def check_cost(self, ctx: TaskContext, items: list[Any], request: Any, limits: Any) -> int:
        """Refuse (413/422) a request whose work or answer would pass a limit, from counts that
        cost nothing (characters, [MASK]s, top_k), before anything is tokenised; return the
        work's size in characters, which decides whether it runs off the event loop."""
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
    _local: threading.local = field(default_factory=threading.local)

    @classmethod
    def load(
        cls, directory: Path, spec: BundleSpec, max_text_chars: int, max_rows: int = 1_000_000
    ) -> TaskContext:
        text = (directory / spec.tokenizer.file).read_text(encoding="utf-8")
        plain = Tokenizer.from_str(text)
        plain.no_truncation()
        plain.no_padding()
        return cls(spec, plain, text, max_text_chars, max_rows)

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

    def max_pieces(self, text: str) -> int:
        """An upper bound on the word pieces of `text`, cheaper than tokenising it: every piece
        covers at least one character of the normalised text."""
        normalizer = self.tokenizer.normalizer
        return len(normalizer.normalize_str(text) if normalizer is not None else text)

    def check_text(self, text: str, what: str = "input") -> str:
        if not text.strip():
            raise InvalidInput(f"{what} is empty")
        if len(text) > self.max_text_chars:
            raise TooLarge(
                f"{what} has {len(text):,} characters; the limit is {self.max_text_chars:,}"
            )
        return text

    def encode(self, text: str, pair: str | None = None, truncate: bool = False) -> Encoding:
        """Encode without cutting; an encoding longer than the model takes is a 413 unless the
        request asked to truncate (refused before tokenising when its words alone are too
        many)."""
        if not truncate and min_tokens(text) + min_tokens(pair or "") > self.max_len:
            raise self.too_long(min_tokens(text) + min_tokens(pair or ""), "at least ")
        if truncate:
            self.windowing.enable_truncation(self.max_len, strategy="longest_first")
            return self.windowing.encode(text, pair)
        enc = self.tokenizer.encode(text, pair)
        if len(enc.ids) > self.max_len:
            raise self.too_long(len(enc.ids))
        return enc

    def too_long(self, tokens: int, qualifier: str = "") -> TooLarge:
        return TooLarge(
            f"input is {qualifier}{tokens} tokens; the model takes {self.max_len}. "
            'Shorten it or send "parameters": {"truncation": true}'
        )


def min_tokens(text: str) -> int:
    """A lower bound on a text's word pieces, for free: every white-space separated word is at
    least one piece. A request refused on it would have been refused after tokenising too."""
    return len(text.split())


def windows_needed(tokens: int, window: int, advance: int) -> int:
    """Windows of `window` tokens, each `advance` tokens after the last, to cover `tokens`."""
    if tokens <= window:
        return 1
    return 1 + -(-(tokens - window) // max(1, advance))


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
