"""/ner: token classification with the transformers token-classification pipeline's aggregation
(none / simple / first / average / max) and character offsets into the caller's text.

Texts longer than the model are cut into overlapping windows of word pieces; each piece takes its
scores from the window where it has the most context on both sides (as SQuAD's max-context rule),
so nothing is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field
from tokenizers import Encoding, Tokenizer

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.encoding import case_type_ids
from bertserve.runtime.errors import TooLarge
from bertserve.runtime.schemas import Int, Params, Request, Text
from bertserve.runtime.tasks.common import (
    Task,
    TaskContext,
    checkpoint,
    min_tokens,
    softmax,
    tokenize,
)


class NerParams(Params):
    # "first": an entity word takes its first piece's label, the piece the model is trained to
    # label (model.training.data.tasks.align_labels). "simple" groups pieces by their own
    # labels, and the untrained labels of later pieces split words ("Leices" ORG, "##tershire"
    # PER): 21.5 entity F1 against 58 with "first" on the same tiny bundle.
    aggregation_strategy: Literal["none", "simple", "first", "average", "max"] = "first"
    ignore_labels: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=lambda: ["O"], max_length=64, description="labels (or types) to leave out"
    )
    stride: Int = Field(32, ge=0, description="overlap of windows over a long text, in tokens")


class NerRequest(Request):
    inputs: Text | Annotated[list[Text], Field(min_length=1)]
    parameters: NerParams = NerParams()


class Entity(BaseModel):
    entity_group: str | None = None
    entity: str | None = None
    index: int | None = None
    score: float
    word: str
    start: int
    end: int


@dataclass
class NerInput:
    text: str
    encoding: Encoding  # the whole text, no specials
    windows: list[tuple[int, int]]  # [start, end) piece ranges, one row each


def windows_for(n: int, size: int, stride: int) -> list[tuple[int, int]]:
    if n <= size:
        return [(0, n)]
    step = max(1, size - stride)
    starts = [*range(0, n - size, step), n - size]
    return [(s, s + size) for s in starts]


def preprocess(ctx: TaskContext, texts: list[str], stride: int) -> tuple[list[NerInput], list[Row]]:
    front, back = ctx.special_frame  # [CLS] ... [SEP] for BERT, <s> ... </s> for RoBERTa
    size = ctx.max_len - len(front) - len(back)
    cased = ctx.spec.tokenizer.case_type_ids
    encoded = []
    windows = 0
    most = ctx.rows_for(len(texts))
    for text in texts:  # every text's windows counted before any row is made
        checkpoint()
        left = (most - windows) * size  # pieces the windows left can hold, at most
        start = 2 * left + (ctx.max_word_chars or 0)
        if ctx.max_word_chars is not None and len(text) > start:
            # A long text's start alone may need more: its pieces, less those of the word the
            # cut may split (at most max_word_chars), are at most the whole text's. A text of
            # one-character pieces ("a.a.a.") is refused from its first characters so.
            pieces = len(tokenize(ctx.tokenizer, text[:start], add_special_tokens=False))
            if pieces - ctx.max_word_chars > left:
                raise too_many_sequences(most, ctx.max_len)
        enc = tokenize(ctx.tokenizer, ctx.check_text(text), add_special_tokens=False)
        spans = windows_for(len(enc), size, min(stride, size // 2))
        windows += len(spans)
        if windows > most:
            raise too_many_sequences(most, ctx.max_len)
        encoded.append((text, enc, spans))
    inputs, rows = [], []
    for text, enc, spans in encoded:
        inputs.append(NerInput(text, enc, spans))
        shapes = case_type_ids(text, enc.offsets, cased) if cased else None
        for start, end in spans:
            ids = np.asarray([*front, *enc.ids[start:end], *back], dtype=np.int64)
            types = np.zeros_like(ids)
            if shapes is not None:
                types[len(front) : len(ids) - len(back)] = shapes[start:end]
            rows.append(Row(ids, types))
    return inputs, rows


def too_many_sequences(max_rows: int, max_len: int) -> TooLarge:
    return TooLarge(
        f"the texts need more than {max_rows} sequences of {max_len} tokens; one request may "
        "use that many. Send shorter texts or fewer inputs"
    )


def piece_scores(ctx: TaskContext, item: NerInput, results: list[RowResult]) -> np.ndarray:
    """(pieces, labels) probabilities, each piece from its max-context window."""
    front, back = (len(side) for side in ctx.special_frame)

    def probs(result: RowResult) -> np.ndarray:  # the specials dropped
        logits = result.outputs["logits"]
        return softmax(logits[front : len(logits) - back].astype(np.float64))

    if len(item.windows) == 1:  # a text in one window: every piece has only that context
        return probs(results[0])
    n = len(item.encoding.ids)
    labels = results[0].outputs["logits"].shape[-1]
    scores = np.zeros((n, labels))
    best = np.full(n, -1.0)
    for (start, end), result in zip(item.windows, results, strict=True):
        window = probs(result)
        for j, piece in enumerate(range(start, end)):
            context = min(piece - start, end - 1 - piece) + 0.01 * (end - start)
            if context > best[piece]:
                best[piece], scores[piece] = context, window[j]
    return scores


def tokens_to_string(ctx: TaskContext, tokens: list[str]) -> str:
    """Word pieces back to text with the tokenizer's own decoder (joins ##, tidies punctuation),
    as transformers' convert_tokens_to_string."""
    return ctx.tokenizer.decoder.decode(tokens)


def postprocess(
    ctx: TaskContext,
    inputs: list[NerInput],
    results: list[RowResult],
    strategy: str,
    ignore_labels: list[str],
) -> list[list[dict]]:
    labels = ctx.spec.labels or []
    unk = ctx.spec.tokenizer.unk_id
    ignore = frozenset(ignore_labels)
    front = len(ctx.special_frame[0])
    word_aware = marks_continuations(ctx.tokenizer)
    out, cursor = [], 0
    for item in inputs:
        checkpoint()
        scores = piece_scores(ctx, item, results[cursor : cursor + len(item.windows)])
        cursor += len(item.windows)
        pre = []
        for idx, (token_id, token, (start, end)) in enumerate(
            zip(item.encoding.ids, item.encoding.tokens, item.encoding.offsets, strict=True)
        ):
            word_ref = item.text[start:end]
            is_subword = piece_is_subword(word_aware, token, item.text, start, end, token_id == unk)
            if token_id == unk:
                token = word_ref
            # transformers counts the leading specials in the index of a token
            pre.append(
                {
                    "word": token,
                    "scores": scores[idx],
                    "start": start,
                    "end": end,
                    "index": idx + front,
                    "is_subword": is_subword,
                }
            )
        out.append(aggregate(ctx, pre, strategy, labels, ignore))
    return out


def marks_continuations(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer marks a word's later pieces ("##" WordPiece), which decides the test
    piece_is_subword applies."""
    return bool(getattr(tokenizer.model, "continuing_subword_prefix", None))


def piece_is_subword(
    word_aware: bool, token: str, text: str, start: int, end: int, unknown: bool
) -> bool:
    """transformers' test for a piece that continues a word: a tokenizer that marks continuations
    ("##" WordPiece) tells them by their length, any other (byte-level BPE, Unigram) by no space
    before them; an unknown piece always starts a word. Training labels exactly the pieces this
    calls word starts (model.training.data.tasks.align_labels)."""
    if unknown:
        return False
    if word_aware:
        return len(token) != end - start  # "##ing" vs "ing"
    return start > 0 and " " not in text[start - 1 : start + 1]


def aggregate(
    ctx: TaskContext,
    pre: list[dict],
    strategy: str,
    labels: list[str],
    ignore: frozenset[str] | list[str],
) -> list[dict]:
    """The entities of one text, those whose label (or group's type) is in `ignore` left out."""
    if strategy in ("none", "simple"):
        entities = []
        for p in pre:
            i = int(p["scores"].argmax())
            entities.append(
                {
                    "entity": labels[i],
                    "score": float(p["scores"][i]),
                    "index": p["index"],
                    "word": p["word"],
                    "start": p["start"],
                    "end": p["end"],
                }
            )
        if strategy == "none":
            return [e for e in entities if e["entity"] not in ignore]
    else:
        entities = aggregate_words(pre, strategy, labels)
    return group_entities(ctx, entities, ignore)


def aggregate_words(pre: list[dict], strategy: str, labels: list[str]) -> list[dict]:
    words, group = [], None
    for p in pre:
        if group is None:
            group = [p]
        elif p["is_subword"]:
            group.append(p)
        else:
            words.append(aggregate_word(group, strategy, labels))
            group = [p]
    if group is not None:
        words.append(aggregate_word(group, strategy, labels))
    return words


def aggregate_word(group: list[dict], strategy: str, labels: list[str]) -> dict:
    """One word of pieces. Its text is left as the pieces (`word` a list), joined only if its
    entity is kept: most words of a text are "O", which the default `ignore_labels` drops."""
    if strategy == "first":
        scores = group[0]["scores"]
    elif strategy == "max":
        scores = max(group, key=lambda p: p["scores"].max())["scores"]
    else:  # average
        scores = np.nanmean(np.stack([p["scores"] for p in group]), axis=0)
    i = int(scores.argmax())
    return {
        "entity": labels[i],
        "score": float(scores[i]),
        "word": [p["word"] for p in group],
        "start": group[0]["start"],
        "end": group[-1]["end"],
    }


def get_tag(name: str) -> tuple[str, str]:
    if name.startswith("B-"):
        return "B", name[2:]
    if name.startswith("I-"):
        return "I", name[2:]
    return "I", name  # not B-/I-: a continuation


def group_entities(
    ctx: TaskContext, entities: list[dict], ignore: frozenset[str] | list[str]
) -> list[dict]:
    """Consecutive entities of one type (B- starts a new one) as one; a group whose type is
    ignored is dropped here, before its text is decoded."""
    groups: list[list[dict]] = []
    current: list[dict] = []
    for entity in entities:
        if not current:
            current.append(entity)
            continue
        bi, tag = get_tag(entity["entity"])
        _, last_tag = get_tag(current[-1]["entity"])
        if tag == last_tag and bi != "B":
            current.append(entity)
        else:
            groups.append(current)
            current = [entity]
    if current:
        groups.append(current)
    kept = [g for g in groups if g[0]["entity"].split("-", 1)[-1] not in ignore]
    return [group_sub_entities(ctx, g) for g in kept]


def word_text(ctx: TaskContext, word: str | list[str]) -> str:
    """A token, or the pieces of a word (aggregate_word) joined as transformers joins them."""
    return word if isinstance(word, str) else tokens_to_string(ctx, word)


def group_sub_entities(ctx: TaskContext, entities: list[dict]) -> dict:
    return {
        "entity_group": entities[0]["entity"].split("-", 1)[-1],
        "score": float(np.nanmean([e["score"] for e in entities])),
        "word": tokens_to_string(ctx, [word_text(ctx, e["word"]) for e in entities]),
        "start": entities[0]["start"],
        "end": entities[-1]["end"],
    }


class Ner(Task):
    path = "/ner"
    capability = "ner"
    reads = ("logits",)
    request = NerRequest
    response = list[Entity] | list[list[Entity]]
    summary = "Named entities with character offsets into each text"
    example: ClassVar[dict[str, Any]] = {"inputs": "Angela Merkel met Emmanuel Macron in Paris."}

    def check_cost(
        self, ctx: TaskContext, items: list[str], request: NerRequest, limits: Any
    ) -> int:
        """Refuse from the words alone (each at least one piece) a request that needs more
        sequences than one may use; `preprocess` counts the exact pieces, text by text, before
        it makes a row. The cost: tokenising, and a few times that to aggregate every piece."""
        size = ctx.max_len - 2
        stride = min(request.parameters.stride, size // 2)
        least = sum(len(windows_for(min_tokens(t), size, stride)) for t in items)
        most = ctx.rows_for(len(items))
        if least > most:
            raise too_many_sequences(most, ctx.max_len)
        return 4 * sum(len(t) for t in items)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: NerRequest
    ) -> tuple[list[Row], list[NerInput]]:
        inputs, rows = preprocess(ctx, items, request.parameters.stride)
        return rows, inputs

    def finish(
        self,
        ctx: TaskContext,
        prepared: list[NerInput],
        results: list[RowResult],
        request: NerRequest,
    ) -> list[Any]:
        p = request.parameters
        return postprocess(ctx, prepared, results, p.aggregation_strategy, p.ignore_labels)


TASK = Ner()
