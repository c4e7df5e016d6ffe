"""Long inputs: a text longer than the model's window cut into chunks of its own word pieces,
each chunk a row of the batcher like any other.

A chunk is a range of the text's pieces (special tokens not counted) that starts and ends
where the text has white space between two pieces; a run of text without any (CJK, a long URL)
is cut at the tokenizer's word boundaries, and a single word longer than a chunk between its
pieces. Its `start`/`end` are character offsets (Unicode code points, as /ner's) of the first
piece's first character and the last piece's last. Chunks advance by at most `chunk_tokens -
overlap_tokens` pieces and overlap by at most `overlap_tokens`, both moved to the nearest word
boundary.

What each endpoint makes of the chunks (`long_input: "chunk"`):
- embeddings: the mean of the chunks' unit vectors, weighted by their pieces (`weighted_mean`);
- classification: the mean of the chunks' logits, weighted the same way;
- rerank: a document's score is its best chunk's.

Late chunking (`POST /embed/chunks` with `late: true`, Günther et al., 2024): the text is cut
into windows of the model's full length, each window's token states computed once, and each
chunk's vector is the mean of its own pieces' states taken from the window in which it has the
most context on both sides (as /ner's max-context rule): a chunk sees the text around it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding

from bertserve.runtime.batching import Row
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.tasks.common import LongInput, TaskContext, checkpoint, row, tokenize

# Pieces two neighbouring chunks share where long inputs are chunked for one answer
# (`long_input: "chunk"`), and /embed/chunks' defaults. A mean of the chunks needs no overlap
# (shared pieces would count twice: window-sized chunks retrieved SQuAD v1.1 dev articles at
# top-1 0.782 with none, 0.781 with 16 and 32, 0.780 with 64); a best chunk does (a passage cut
# in two is whole in one of two overlapping chunks). docs/reports/long-inputs.md.
MEAN_OVERLAP_TOKENS = 0
BEST_OVERLAP_TOKENS = 32
DEFAULT_CHUNK_TOKENS = 128
DEFAULT_OVERLAP_TOKENS = 16


@dataclass(frozen=True)
class Chunk:
    first: int  # the text's pieces [first, last) (special tokens not counted)
    last: int
    start: int  # characters [start, end) of the text
    end: int

    @property
    def tokens(self) -> int:
        return self.last - self.first


def long_mode(ctx: TaskContext, asked: LongInput | None, truncate: bool | None = None) -> LongInput:
    """What a request does with an over-long input: its `long_input`; else its `truncate` (true:
    cut, false: refuse); else the service's `long_input` (BERTSERVE_AUTO_TRUNCATE makes its
    "error" a "truncate")."""
    if asked is not None:
        return asked
    if truncate is not None:
        return "truncate" if truncate else "error"
    return ctx.long_input


def boundaries(text: str, enc: Encoding) -> list[int]:
    """A rank for each place between pieces (index i: before piece i; 0 and len(enc): the
    text's ends): 2 where the text has white space between the pieces, 1 at another word
    boundary of the tokenizer's pre-tokenizer (punctuation, a CJK character), 0 inside a word."""
    n = len(enc)
    ranks = [2] * (n + 1)
    offsets, words = enc.offsets, enc.word_ids
    for i in range(1, n):
        if text[offsets[i - 1][1] : offsets[i][0]].isspace():  # "" (adjacent pieces) is not
            ranks[i] = 2
        elif words[i] != words[i - 1]:
            ranks[i] = 1
        else:
            ranks[i] = 0
    return ranks


def plan(ranks: list[int], size: int, overlap: int) -> list[tuple[int, int]]:
    """Piece ranges [first, last) of at most `size` pieces covering pieces 0..len(ranks)-1, each
    ending at the best-ranked boundary of its second half (the latest of that rank), the next
    starting at the best-ranked boundary at most `overlap` pieces before (the earliest of that
    rank), so chunks overlap by at most `overlap` and always advance."""
    n = len(ranks) - 1
    if n <= size:
        return [(0, n)]
    spans: list[tuple[int, int]] = []
    first = 0
    while True:
        limit = first + size
        if limit >= n:
            spans.append((first, n))
            return spans
        low = first + max(1, size // 2)
        last = max(range(low, limit + 1), key=lambda b: (ranks[b], b))
        spans.append((first, last))
        if overlap <= 0:
            first = last
            continue
        earliest = max(first + 1, last - overlap)
        first = max(range(earliest, last + 1), key=lambda b: (ranks[b], -b))


def chunks_of(
    text: str, enc: Encoding, size: int, overlap: int, ranks: list[int] | None = None
) -> list[Chunk]:
    """The chunks of `text` (its encoding `enc`, no special tokens) of at most `size` pieces."""
    if len(enc) == 0:  # nothing the tokenizer keeps (a zero-width space): one empty chunk
        return [Chunk(0, 0, 0, len(text))]
    ranks = boundaries(text, enc) if ranks is None else ranks
    offsets = enc.offsets
    return [
        Chunk(first, last, offsets[first][0], offsets[last - 1][1])
        for first, last in plan(ranks, size, overlap)
    ]


def id_chunks(count: int, size: int, overlap: int) -> list[Chunk]:
    """Chunks of a client's token ids (no text: every place is a boundary, no offsets)."""
    return [Chunk(a, b, 0, 0) for a, b in plan([2] * (count + 1), size, overlap)]


def late_windows(n: int, room: int, longest: int, chunks: list[Chunk] | None = None) -> list[int]:
    """Starts of windows of `room` pieces over `n` pieces such that every range of at most
    `longest` pieces lies whole in one: every `room - longest` pieces, the last ending at n; or,
    where `chunks` are given and that grid would have more windows than they are, a window
    centred on each chunk."""
    if n <= room:
        return [0]
    step = max(1, room - longest)
    grid = [*range(0, n - room, step), n - room]
    if chunks is None or len(grid) <= len(chunks):
        return grid
    centred = [min(max(0, (c.first + c.last - room) // 2), n - room) for c in chunks]
    return sorted(set(centred))


def window_for(chunk: Chunk, starts: list[int], room: int) -> int:
    """The index of the window in which `chunk` lies whole and has the most pieces around it on
    its shorter side."""
    best, where = -1, -1
    for i, s in enumerate(starts):
        if s <= chunk.first and chunk.last <= s + room:
            context = min(chunk.first - s, s + room - chunk.last)
            if context > best:
                best, where = context, i
    if where < 0:
        raise AssertionError(f"no window holds pieces {chunk.first}..{chunk.last}")
    return where


def too_many(rows: int, limit: int, max_len: int) -> TooLarge:
    return TooLarge(
        f"the inputs need more than {limit} sequences of up to {max_len} tokens (their chunks); "
        f"one request may use {limit} (BERTSERVE_MAX_REQUEST_ROWS). Send fewer or shorter "
        "documents a request, or larger chunks"
    )


@dataclass
class Document:
    """A text to chunk: its encoding without special tokens, and its chunks."""

    text: str
    encoding: Encoding
    chunks: list[Chunk]


def documents(
    ctx: TaskContext,
    texts: list[str],
    size: int,
    overlap: int,
    what: str = "input",
    most_chunks: int | None = None,
    late_room: int | None = None,
) -> list[Document]:
    """Each text tokenised and chunked (at most `size` pieces a chunk; its first `most_chunks`
    chunks, if that is set), the sequences they become counted against the request's
    (`ctx.rows_for`) before any row is made: a chunk each, or with `late_room` the windows of
    that many pieces that hold them."""
    if overlap >= size:
        raise InvalidInput(f"overlap_tokens {overlap} must be less than chunk_tokens {size}")
    most, count, out = ctx.rows_for(len(texts)), 0, []
    for i, text in enumerate(texts):
        checkpoint()
        name = what if len(texts) == 1 else f"{what} {i}"
        enc = tokenize(ctx.tokenizer, ctx.check_text(text, name), add_special_tokens=False)
        chunks = chunks_of(text, enc, size, overlap)[:most_chunks]
        if late_room is None:
            count += len(chunks)
        else:
            count += len(late_windows(chunks[-1].last, late_room, size, chunks))
        if count > most:
            raise too_many(count, most, ctx.max_len)
        out.append(Document(text, enc, chunks))
    return out


def room(ctx: TaskContext, prompt: int = 0) -> int:
    """Pieces of a text one sequence holds beside the special tokens and a prompt of `prompt`
    pieces."""
    front, back = ctx.special_frame
    return ctx.max_len - len(front) - len(back) - prompt


def check_chunk_tokens(ctx: TaskContext, size: int, prompt: int = 0) -> None:
    most = room(ctx, prompt)
    if size > most:
        raise InvalidInput(
            f"chunk_tokens {size} is more than model {ctx.spec.name} takes: at most {most} "
            f"(its {ctx.max_len}-token window less its special tokens"
            + (" and the prompt)" if prompt else ")")
        )


def prompt_pieces(ctx: TaskContext, prompt: str) -> list[int]:
    """A prompt's pieces as they go before every chunk or window (no special tokens)."""
    return tokenize(ctx.tokenizer, prompt, add_special_tokens=False).ids if prompt else []


@dataclass
class Groups:
    """Which rows are whose: input i's rows are `spans[i]` (a range of the request's rows), and
    `weights[i]` their pieces (a chunk's own, for the weighted mean)."""

    spans: list[range]
    weights: list[list[int]]

    @classmethod
    def one_each(cls, count: int) -> Groups:
        return cls([range(i, i + 1) for i in range(count)], [[1] for _ in range(count)])

    def chunked(self, i: int) -> bool:
        return len(self.spans[i]) > 1


def weighted_mean(values: list[np.ndarray], weights: list[int]) -> np.ndarray:
    """The mean of `values`, each counted by its weight (a chunk's pieces)."""
    if len(values) == 1:  # a text that fits one window, the usual case: the mean is itself
        return values[0].astype(np.float64)
    w = np.asarray(weights, dtype=np.float64)
    stacked = np.stack([v.astype(np.float64) for v in values])
    return (stacked * w[:, None]).sum(0) / w.sum()


def chunk_rows(
    ctx: TaskContext,
    texts: list[str],
    size: int,
    overlap: int,
    encode: Callable[[str], Encoding],
    what: str = "input",
    most_chunks: int | None = None,
) -> tuple[list[Row], Groups]:
    """A row a chunk of each text (`encode` of the chunk's text: what a client sending that text
    would get), and which rows are whose; a text that fits is one row, as without chunking."""
    docs = documents(ctx, texts, size, overlap, what, most_chunks)
    rows: list[Row] = []
    spans, weights = [], []
    for doc in docs:
        checkpoint()
        start = len(rows)
        chunks = doc.chunks
        if len(chunks) == 1 and chunks[0].first == 0 and chunks[0].last == len(doc.encoding):
            rows.append(row(encode(doc.text)))  # the whole text, as sent
        else:
            rows.extend(row(encode(doc.text[c.start : c.end])) for c in chunks)
        spans.append(range(start, len(rows)))
        weights.append([c.tokens for c in chunks])
    return rows, Groups(spans, weights)
