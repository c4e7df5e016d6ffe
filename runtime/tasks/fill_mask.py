"""/fill-mask: the top-k tokens for each mask token, as the transformers fill-mask pipeline
(scores are probabilities over the whole vocabulary, also when `targets` restricts the choice).
The mask token is the model's: [MASK] for BERT, <mask> for RoBERTa and XLM-R (GET /models)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field

from bertserve.runtime.batching import Row, RowResult
from bertserve.runtime.errors import InvalidInput, TooLarge
from bertserve.runtime.schemas import Int, Params, Request
from bertserve.runtime.tasks.common import (
    Task,
    TaskContext,
    checkpoint,
    row,
    softmax,
    top_k_indices,
)

MaskedText = Annotated[
    str,
    Field(
        min_length=1,
        description="contains the model's mask token at least once: [MASK] for BERT, <mask> for "
        "RoBERTa and XLM-R (GET /models: mask_token)",
    ),
]


class FillMaskParams(Params):
    top_k: Int = Field(5, ge=1, le=100)
    targets: list[Annotated[str, Field(min_length=1, max_length=100)]] | None = Field(
        None, min_length=1, max_length=1000, description="words to choose among (at most 1,000)"
    )
    truncation: bool = False


class FillMaskRequest(Request):
    inputs: MaskedText | Annotated[list[MaskedText], Field(min_length=1)]
    parameters: FillMaskParams = FillMaskParams()


class FillMaskItem(BaseModel):
    score: float
    token: int
    token_str: str
    sequence: str


def target_ids(ctx: TaskContext, targets: list[str] | None) -> np.ndarray | None:
    if targets is None:
        return None
    ids = [ctx.tokenizer.token_to_id(target) for target in targets]
    words = [t for t, i in zip(targets, ids, strict=True) if i is None]
    # As transformers: a target that is no token of the vocabulary is its first word piece.
    pieces = ctx.tokenizer.encode_batch(words, add_special_tokens=False) if words else []
    ids = [i for i in ids if i is not None] + [p.ids[0] for p in pieces if p.ids]
    ids = sorted(set(ids))
    if not ids:
        raise InvalidInput(f"targets {targets[:5]} give no token of the vocabulary")
    return np.asarray(ids)


def preprocess(ctx: TaskContext, texts: list[str], truncate: bool) -> list[Row]:
    mask_token = ctx.spec.tokenizer.mask_token
    rows = []
    for text in texts:
        enc = ctx.encode(ctx.check_text(text), truncate=truncate)
        positions = np.flatnonzero(np.asarray(enc.ids) == ctx.spec.tokenizer.mask_id)
        if not len(positions):
            raise InvalidInput(f"input has no {mask_token} token: {text[:80]!r}")
        rows.append(row(enc, positions.astype(np.int64)))
    return rows


def postprocess(
    ctx: TaskContext,
    rows: list[Row],
    results: list[RowResult],
    top_k: int,
    targets: np.ndarray | None,
) -> list[list[dict] | list[list[dict]]]:
    out: list[list[dict] | list[list[dict]]] = []
    k = min(top_k, len(targets)) if targets is not None else top_k
    for r, result in zip(rows, results, strict=True):
        checkpoint()
        logits = result.outputs["mlm_logits"].astype(np.float64)  # (P, V)
        positions = r.mask_positions if r.mask_positions is not None else np.zeros(0, np.int64)
        single = len(positions) == 1
        per_mask = []
        for slot, position in enumerate(positions):
            probs = softmax(logits[slot])
            if targets is None:
                order = top_k_indices(probs, k)
            else:
                order = targets[top_k_indices(probs[targets], k)]
            items = []
            for token_id in order:
                ids = r.input_ids.copy()
                ids[position] = token_id
                items.append(
                    {
                        "score": float(probs[token_id]),
                        "token": int(token_id),
                        "token_str": ctx.tokenizer.decode([int(token_id)]),
                        # transformers keeps the other [MASK]s (and specials) when there are several
                        "sequence": ctx.tokenizer.decode(ids.tolist(), skip_special_tokens=single),
                    }
                )
            per_mask.append(items)
        out.append(per_mask[0] if single else per_mask)
    return out


class FillMask(Task):
    path = "/fill-mask"
    capability = "fill-mask"
    reads = ("mlm_logits",)
    request = FillMaskRequest
    response = list[FillMaskItem] | list[list[FillMaskItem]] | list[list[list[FillMaskItem]]]
    summary = "The most likely tokens for each [MASK]"
    example: ClassVar[dict[str, Any]] = {"inputs": "Paris is the [MASK] of France."}

    def check_cost(
        self, ctx: TaskContext, items: list[str], request: FillMaskRequest, limits: Any
    ) -> int:
        """Every candidate is a decoded sentence: inputs x [MASK]s x top_k of them, each as
        long as its input. Counted on the raw text, before anything is tokenised."""
        p = request.parameters
        k = min(p.top_k, len(p.targets)) if p.targets else p.top_k
        mask = ctx.spec.tokenizer.mask_token
        unmasked = next((t for t in items if mask not in t), None)
        if unmasked is not None:
            raise InvalidInput(f"input has no {mask} (this model's mask token): {unmasked[:80]!r}")
        candidates = sum(t.count(mask) for t in items) * k
        if candidates > limits.max_fill_mask_candidates:
            raise TooLarge(
                f"{candidates:,} candidates asked for (inputs x [MASK]s x top_k); the limit is "
                f"{limits.max_fill_mask_candidates:,}. Send fewer [MASK]s or a smaller top_k"
            )
        targets = sum(len(t) for t in p.targets or ())  # each tokenised
        return targets + sum(len(t) * max(1, t.count(mask) * k) for t in items)

    def prepare(
        self, ctx: TaskContext, items: list[str], request: FillMaskRequest
    ) -> tuple[list[Row], tuple[list[Row], np.ndarray | None]]:
        targets = target_ids(ctx, request.parameters.targets)
        rows = preprocess(ctx, items, request.parameters.truncation)
        return rows, (rows, targets)

    def finish(
        self,
        ctx: TaskContext,
        prepared: tuple[list[Row], np.ndarray | None],
        results: list[RowResult],
        request: FillMaskRequest,
    ) -> list[Any]:
        rows, targets = prepared
        return postprocess(ctx, rows, results, request.parameters.top_k, targets)


TASK = FillMask()
