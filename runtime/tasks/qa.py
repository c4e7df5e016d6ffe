"""/qa: extractive question answering, as the transformers question-answering pipeline.

Question and context are encoded by the tokenizer's pair template (`[CLS] question [SEP] context
[SEP]` for BERT, `<s> question </s></s> context </s>` for RoBERTa); a context longer than
`max_seq_len` is cut into windows overlapping by `doc_stride` tokens (the tokenizer's own
overflow), every window is scored, and the best spans across windows win. A span starts and ends
inside the context, end >= start, at most `max_answer_len` tokens, and is widened to whole words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field
from tokenizers import Encoding

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import TooLarge
from bertserve.runtime.schemas import STRICT, Int, Params, Request, Text
from bertserve.runtime.tasks.common import (
    Task,
    TaskContext,
    checkpoint,
    min_tokens,
    row,
    softmax,
    tokenize,
    windows_needed,
)


class QaInput(BaseModel):
    model_config = STRICT
    question: Text
    context: Text


class QaParams(Params):
    top_k: Int = Field(1, ge=1, le=100)
    doc_stride: Int = Field(
        128,
        ge=0,
        description="overlap of a long context's windows; capped at half the window (the "
        "context's share of max_seq_len)",
    )
    max_answer_len: Int = Field(15, ge=1, le=512)
    max_seq_len: Int = Field(384, ge=16, le=512, description="capped at the model's length")
    max_question_len: Int = Field(
        64,
        ge=1,
        description="a longer question is cut to its first max_question_len tokens (as BERT's "
        "SQuAD code does), and to at most half of max_seq_len",
    )
    handle_impossible_answer: bool = False


class QaRequest(Request):
    inputs: QaInput | Annotated[list[QaInput], Field(min_length=1)]
    parameters: QaParams = QaParams()


class Answer(BaseModel):
    answer: str
    score: float
    start: int
    end: int


@dataclass
class QaWindows:
    context: str
    windows: list[Encoding]


def context_window(
    max_seq_len: int, question_len: int, doc_stride: int, specials: int = 3
) -> tuple[int, int]:
    """(context tokens a window holds, overlap between windows): the overlap is kept to at most
    half a window, as /ner's, so a long context costs at most twice its length in windows.
    `specials`: the pair template's special tokens (3 for BERT, 4 for RoBERTa)."""
    window = max_seq_len - question_len - specials
    return window, min(doc_stride, window // 2)


def preprocess(
    ctx: TaskContext,
    pairs: list[tuple[str, str]],
    max_seq_len: int,
    doc_stride: int,
    max_question_len: int,
) -> tuple[list[QaWindows], list[Row]]:
    max_seq_len = min(max_seq_len, ctx.max_len)
    tok = ctx.windowing
    specials = ctx.tokenizer.num_special_tokens_to_add(True)
    inputs: list[QaWindows] = []
    rows: list[Row] = []
    most = ctx.rows_for(len(pairs))
    for question, context in pairs:
        checkpoint()
        ctx.check_text(question, "question")
        ctx.check_text(context, "context")
        question, question_len = cut_question(
            ctx, question, min(max_question_len, (max_seq_len - specials) // 2)
        )
        window, stride = context_window(max_seq_len, question_len, doc_stride, specials)
        # Count the windows before making them: the tokenizer's overflow builds every one. The
        # normalised length bounds the pieces at a quarter of a tokenisation's cost; only a
        # context that could pass the limit by that bound is counted exactly.
        advance = window - stride
        if len(rows) + windows_needed(ctx.max_pieces(context), window, advance) > most:
            context_len = len(tokenize(ctx.tokenizer, context, add_special_tokens=False))
            if len(rows) + windows_needed(context_len, window, advance) > most:
                raise too_many_windows(most, max_seq_len)
        tok.enable_truncation(max_seq_len, stride=stride, strategy="only_second")
        first = tokenize(tok, question, context)
        windows = [first, *first.overflowing]
        inputs.append(QaWindows(context, windows))
        rows.extend(row(w) for w in windows)
    return inputs, rows


def cut_question(ctx: TaskContext, question: str, most: int) -> tuple[str, int]:
    """The question cut at a piece boundary to at most `most` pieces, and its length in pieces."""
    pieces = tokenize(ctx.tokenizer, question, add_special_tokens=False)
    n = len(pieces)
    while n > most:
        question = question[: pieces.offsets[most - 1][1]]
        pieces = tokenize(ctx.tokenizer, question, add_special_tokens=False)
        n, most = len(pieces), most - (len(pieces) > most)  # a cut word can grow a piece
    return question, n


def too_many_windows(max_rows: int, max_seq_len: int) -> TooLarge:
    return TooLarge(
        f"the contexts need more than {max_rows} windows of {max_seq_len} tokens; one request "
        "may use that many. Send shorter contexts or fewer inputs"
    )


def decode_spans(
    start: np.ndarray, end: np.ndarray, top_k: int, max_answer_len: int, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best (start, end) pairs by P(start) x P(end), end >= start, length <= max_answer_len,
    both inside `allowed` positions, best first.

    Only the band of spans up to `max_answer_len` is scored (L x max_answer_len cells, not the
    pipeline's L x L matrix, which was 40% of the event loop's time on /qa); when the band holds
    fewer non-zero candidates than asked, the pipeline's own full-matrix computation decides, so
    its zero-score picks are the same too."""
    n = len(start)
    width = min(max_answer_len, n)
    ends = np.arange(n)[:, None] + np.arange(width)[None, :]  # (n, width): end of each span
    inside = ends < n
    ends = np.minimum(ends, n - 1)
    band = (start[:, None] * end[ends] * inside).ravel()
    if np.count_nonzero(band) < top_k:
        return _decode_full(start, end, top_k, max_answer_len, allowed)
    if top_k == 1:
        picked = np.array([np.argmax(band)])
    else:
        picked = np.argpartition(-band, top_k - 1)[:top_k]
    starts, span_ends, scores = picked // width, ends.ravel()[picked], band[picked]
    # Best first; equal scores in the full matrix's row-major order, as np.argmax there.
    order = np.lexsort((starts * n + span_ends, -scores))
    starts, span_ends, scores = starts[order], span_ends[order], scores[order]
    ok = allowed[starts] & allowed[span_ends]
    return starts[ok], span_ends[ok], scores[ok]


def _decode_full(
    start: np.ndarray, end: np.ndarray, top_k: int, max_answer_len: int, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The transformers question-answering pipeline's decoding, step for step."""
    outer = np.outer(start, end)
    candidates = np.tril(np.triu(outer), max_answer_len - 1)
    flat = candidates.flatten()
    if top_k == 1:
        order = np.array([np.argmax(flat)])
    elif len(flat) < top_k:
        order = np.argsort(-flat)
    else:
        part = np.argpartition(-flat, top_k)[:top_k]
        order = part[np.argsort(-flat[part])]
    starts, ends = np.unravel_index(order, candidates.shape)
    ok = np.isin(starts, allowed.nonzero()) & np.isin(ends, allowed.nonzero())
    starts, ends = starts[ok], ends[ok]
    return starts, ends, candidates[starts, ends]


def postprocess(
    ctx: TaskContext,
    inputs: list[QaWindows],
    results: list[RowResult],
    top_k: int,
    max_answer_len: int,
    handle_impossible_answer: bool,
) -> list[dict | list[dict]]:
    cls_id = ctx.spec.tokenizer.cls_id
    out: list[dict | list[dict]] = []
    cursor = 0
    for item in inputs:
        # One answer a text, found in any window: keyed by its lower-cased text, so merging
        # windows x candidates is linear (a list scan made 61 windows at top_k 100 take 20 s).
        answers: dict[str, dict[str, Any]] = {}
        min_null = 1_000_000.0
        for enc in item.windows:
            checkpoint()
            result = results[cursor]
            cursor += 1
            # Context tokens (sequence 1) and [CLS] may be chosen; question, [SEP] may not.
            allowed = np.array([s == 1 for s in enc.sequence_ids], dtype=bool)
            allowed[np.asarray(enc.ids) == cls_id] = True
            start = np.where(allowed, result.outputs["start_logits"], -10000.0).astype(np.float64)
            end = np.where(allowed, result.outputs["end_logits"], -10000.0).astype(np.float64)
            start, end = softmax(start), softmax(end)
            if handle_impossible_answer:
                min_null = min(min_null, float(start[0] * end[0]))
            start[0] = end[0] = 0.0
            # Widening to whole words can merge candidates: decode more than asked for.
            starts, ends, scores = decode_spans(start, end, 2 * top_k + 10, max_answer_len, allowed)
            for s, e, score in zip(starts, ends, scores, strict=True):
                first, last = word_span(enc, int(s), int(e))
                text = item.context[first:last]
                same = answers.get(text.lower())
                if same is not None:  # one answer found twice (overlapping windows, or words)
                    same["score"] += float(score)
                else:
                    answers[text.lower()] = {
                        "score": float(score),
                        "start": first,
                        "end": last,
                        "answer": text,
                    }
        ranked = list(answers.values())
        if handle_impossible_answer:
            ranked.append({"score": min_null, "start": 0, "end": 0, "answer": ""})
        ranked = sorted(ranked, key=lambda a: a["score"], reverse=True)[:top_k]
        out.append(ranked[0] if len(ranked) == 1 else ranked)
    return out


def word_span(enc: Encoding, s: int, e: int) -> tuple[int, int]:
    """Character span of the whole words holding tokens s..e (a token may sit mid-word)."""
    start_word, end_word = enc.token_to_word(s), enc.token_to_word(e)
    if start_word is None or end_word is None:
        return enc.offsets[s][0], enc.offsets[e][1]
    return (
        enc.word_to_chars(start_word, sequence_index=1)[0],
        enc.word_to_chars(end_word, sequence_index=1)[1],
    )


class Qa(Task):
    path = "/qa"
    capability = "qa"
    reads = ("start_logits", "end_logits")
    request = QaRequest
    response = Answer | list[Answer] | list[Answer | list[Answer]]
    summary = "Extract the answer to a question from its context"
    example: ClassVar[dict[str, Any]] = {
        "inputs": {
            "question": "Where was Aristotle born?",
            "context": "Aristotle was born in Stagira in 384 BC.",
        }
    }

    def check_cost(
        self, ctx: TaskContext, items: list[QaInput], request: QaRequest, limits: Any
    ) -> int:
        p = request.parameters
        max_len = min(p.max_seq_len, ctx.max_len)
        rows = ctx.rows_for(len(items))
        # Free lower bound: every word of a context is at least one token of its windows.
        least = 0
        # And the decode's work, which grows with windows x the band of spans scored x the
        # candidates widened and merged (2 x top_k + 10 a window), in characters of
        # tokenising: heavy parameters send even a short context off the event loop.
        decode = max_len * min(p.max_answer_len, max_len) // 16 + 4 * (2 * p.top_k + 10)
        cost = 0
        specials = ctx.tokenizer.num_special_tokens_to_add(True)
        for item in items:
            window, stride = context_window(
                max_len, min_tokens(item.question), p.doc_stride, specials
            )
            window, advance = max(1, window), max(1, window - stride)
            least += windows_needed(min_tokens(item.context), window, advance)
            likely = min(rows, windows_needed(len(item.context) // 4, window, advance))
            cost += len(item.question) + len(item.context) + likely * decode
        if least > rows:
            raise too_many_windows(rows, max_len)
        return cost

    def prepare(
        self, ctx: TaskContext, items: list[QaInput], request: QaRequest
    ) -> tuple[list[Row], list[QaWindows]]:
        p = request.parameters
        pairs = [(i.question, i.context) for i in items]
        inputs, rows = preprocess(ctx, pairs, p.max_seq_len, p.doc_stride, p.max_question_len)
        return rows, inputs

    def finish(
        self,
        ctx: TaskContext,
        prepared: list[QaWindows],
        results: list[RowResult],
        request: QaRequest,
    ) -> list[Any]:
        p = request.parameters
        return postprocess(
            ctx, prepared, results, p.top_k, p.max_answer_len, p.handle_impossible_answer
        )


TASK = Qa()
