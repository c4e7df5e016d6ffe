"""BERT pre-training examples: NSP segment pairs built once, masks redrawn every epoch.

Pairs follow google-research/bert `create_pretraining_data.py`: sentences are gathered inside a
document until a target length (usually the maximum, sometimes shorter so the model also sees
short inputs), cut at a random sentence into A and B; half the time B is replaced by a span from
another document and the sentences it displaced are put back to be used in the next pair. Pairs
are trimmed to fit, one token at a time from a random end of the longer segment.

With `sentence_pair_prob` a document instead gives single-sentence pairs: each sentence as A,
and as B the sentence after it or, half the time, one sentence of another document. That is the
question /nsp is asked (two sentences), which segment pairs of up to 128 tokens do not teach.

Pairs are stored pre-tokenised (uint16 token ids in one flat file plus an index), so the training
loop never tokenises. Masking happens when a batch is drawn: 15% of ordinary tokens are chosen,
80% become [MASK], 10% a random token, 10% stay; [CLS]/[SEP]/[PAD] are never chosen. The draw is
seeded by (seed, epoch, example), so a resumed run sees exactly the masks it would have seen.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IS_NEXT, NOT_NEXT = 0, 1  # NSP labels: 0 = B really follows A
NUM_SPECIALS = 5  # [PAD] [UNK] [CLS] [SEP] [MASK] are ids 0..4; random replacements avoid them


@dataclass(frozen=True)
class Pair:
    a: list[int]
    b: list[int]
    label: int  # IS_NEXT or NOT_NEXT


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment, from its front or back at random, until both fit."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def pairs_from_document(
    docs: Sequence[list[list[int]]],  # documents as lists of tokenised sentences
    index: int,
    max_seq_len: int,
    short_seq_prob: float,
    rng: random.Random,
    sentence_pair_prob: float = 0.0,
) -> list[Pair]:
    max_tokens = max_seq_len - 3  # [CLS] A [SEP] B [SEP]
    # Drawn only when asked for, so that data prepared without it stays the same.
    if sentence_pair_prob > 0 and rng.random() < sentence_pair_prob:
        return sentence_pairs(docs, index, max_tokens, rng)
    # Usually fill the whole budget; sometimes a shorter target, to close the gap between
    # pre-training (long inputs) and fine-tuning (often short ones).
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    document = docs[index]
    pairs: list[Pair] = []
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for s in chunk[:a_end] for t in s]
            if len(chunk) == 1 or rng.random() < 0.5:
                label = NOT_NEXT
                b = _random_segment(docs, index, max(1, target - len(a)), rng)
                # Put back the sentences B would have used: they start the next pair.
                i -= len(chunk) - a_end
            else:
                label = IS_NEXT
                b = [t for s in chunk[a_end:] for t in s]
            truncate_pair(a, b, max_tokens, rng)
            if a and b:
                pairs.append(Pair(a, b, label))
            chunk, length = [], 0
            # Google draws the target once per document; drawing it per pair spreads the short
            # examples evenly over long and short articles.
            target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
        i += 1
    return pairs


def sentence_pairs(
    docs: Sequence[list[list[int]]], index: int, max_tokens: int, rng: random.Random
) -> list[Pair]:
    """Every sentence but the last as A; B the next sentence or a random sentence of another
    document, half and half."""
    document = docs[index]
    pairs: list[Pair] = []
    for i in range(len(document) - 1):
        a = list(document[i])
        if rng.random() < 0.5:
            label, b = IS_NEXT, list(document[i + 1])
        else:
            other = docs[_other_document(len(docs), index, rng)]
            label, b = NOT_NEXT, list(other[rng.randrange(len(other))])
        truncate_pair(a, b, max_tokens, rng)
        if a and b:
            pairs.append(Pair(a, b, label))
    return pairs


def _other_document(count: int, exclude: int, rng: random.Random) -> int:
    other = exclude
    for _ in range(10):  # a different document (in a corpus of one, the same is all there is)
        other = rng.randrange(count)
        if other != exclude:
            break
    return other


def _random_segment(
    docs: Sequence[list[list[int]]], exclude: int, target: int, rng: random.Random
) -> list[int]:
    sentences = docs[_other_document(len(docs), exclude, rng)]
    start = rng.randrange(len(sentences))
    out: list[int] = []
    for sentence in sentences[start:]:
        out.extend(sentence)
        if len(out) >= target:
            break
    return out


# --- shards -------------------------------------------------------------------------------------


def write_pairs(pairs: Sequence[Pair], directory: str | Path, vocab_size: int) -> None:
    """`tokens.bin` (uint16, A then B of every pair back to back) + `index.npy` (N, 4):
    offset, len(A), len(B), NSP label."""
    if vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint16 shards")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = np.zeros((len(pairs), 4), dtype=np.int64)
    offset = 0
    with open(directory / "tokens.bin", "wb") as f:
        for row, pair in enumerate(pairs):
            index[row] = (offset, len(pair.a), len(pair.b), pair.label)
            f.write(np.asarray(pair.a + pair.b, dtype=np.uint16).tobytes())
            offset += len(pair.a) + len(pair.b)
    np.save(directory / "index.npy", index)
    (directory / "meta.json").write_text(json.dumps({"pairs": len(pairs), "tokens": offset}))


@dataclass
class MaskingConfig:
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    vocab_size: int
    max_seq_len: int
    max_predictions: int
    mask_prob: float = 0.15


class PairShard:
    """Reads a shard written by `write_pairs` and assembles masked, padded batches."""

    def __init__(self, directory: str | Path, masking: MaskingConfig) -> None:
        directory = Path(directory)
        self.index = np.load(directory / "index.npy")
        self.tokens = np.memmap(directory / "tokens.bin", dtype=np.uint16, mode="r")
        self.masking = masking

    def __len__(self) -> int:
        return len(self.index)

    def batch(
        self, rows: Sequence[int] | np.ndarray, seed: int, epoch: int
    ) -> dict[str, np.ndarray]:
        """Masked batch of the given pair indices, padded to max_seq_len (int64 arrays):
        input_ids, token_type_ids, attention_mask (B, S); mlm_positions, mlm_labels (B, P)
        with label -100 on unused prediction slots; next_sentence_label (B,)."""
        m = self.masking
        n = len(rows)
        out = {
            "input_ids": np.full((n, m.max_seq_len), m.pad_id, dtype=np.int64),
            "token_type_ids": np.zeros((n, m.max_seq_len), dtype=np.int64),
            "attention_mask": np.zeros((n, m.max_seq_len), dtype=np.int64),
            "mlm_positions": np.zeros((n, m.max_predictions), dtype=np.int64),
            "mlm_labels": np.full((n, m.max_predictions), -100, dtype=np.int64),
            "next_sentence_label": np.zeros(n, dtype=np.int64),
        }
        for i, row in enumerate(rows):
            offset, len_a, len_b, label = (int(x) for x in self.index[row])
            ids = self.tokens[offset : offset + len_a + len_b].astype(np.int64)
            seq = np.concatenate([[m.cls_id], ids[:len_a], [m.sep_id], ids[len_a:], [m.sep_id]])
            length = len(seq)
            out["token_type_ids"][i, len_a + 2 : length] = 1
            out["attention_mask"][i, :length] = 1
            out["next_sentence_label"][i] = label
            rng = np.random.default_rng([seed, epoch, int(row)])
            positions, labels, seq = mask_sequence(seq, len_a, m, rng)
            out["input_ids"][i, :length] = seq
            out["mlm_positions"][i, : len(positions)] = positions
            out["mlm_labels"][i, : len(positions)] = labels
        return out


def mask_sequence(
    seq: np.ndarray, len_a: int, m: MaskingConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Choose 15% of the ordinary tokens of `[CLS] A [SEP] B [SEP]` and corrupt them 80/10/10.
    Returns (sorted positions, original ids there, corrupted sequence)."""
    length = len(seq)
    candidates = np.concatenate([np.arange(1, len_a + 1), np.arange(len_a + 2, length - 1)])
    count = min(m.max_predictions, max(1, round(len(candidates) * m.mask_prob)))
    positions = np.sort(rng.choice(candidates, size=count, replace=False))
    labels = seq[positions].copy()
    seq = seq.copy()
    draw = rng.random(count)
    to_mask = draw < 0.8
    to_random = (draw >= 0.8) & (draw < 0.9)
    seq[positions[to_mask]] = m.mask_id
    seq[positions[to_random]] = rng.integers(NUM_SPECIALS, m.vocab_size, size=int(to_random.sum()))
    return positions, labels, seq
