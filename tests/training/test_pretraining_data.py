"""The BERT example builder: NSP pairs and 80/10/10 dynamic masking."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bertserve.model.training.data.pretraining import (
    IS_NEXT,
    NOT_NEXT,
    MaskingConfig,
    PairShard,
    mask_sequence,
    pairs_from_document,
    write_pairs,
)

CLS, SEP, MASK, PAD = 2, 3, 4, 0
VOCAB = 5000


def make_docs(n_docs=20, sentences=12, length=6):
    """Document d's sentence s is the tokens [base .. base+length), base = 1000*d + 10*s + 5:
    every token says which document and sentence it came from."""
    return [
        [[1000 * d + 10 * s + 5 + k for k in range(length)] for s in range(sentences)]
        for d in range(n_docs)
    ]


def source(token):
    return (token - 5) // 1000, ((token - 5) % 1000) // 10


def all_pairs(docs, max_seq_len=64, short_seq_prob=0.1, seed=0):
    rng = random.Random(seed)
    return [
        (i, p)
        for i in range(len(docs))
        for p in pairs_from_document(docs, i, max_seq_len, short_seq_prob, rng)
    ]


def test_lengths_within_budget_and_both_segments_present():
    for max_len in (16, 40, 64):
        for _, pair in all_pairs(make_docs(), max_seq_len=max_len):
            assert pair.a and pair.b
            assert len(pair.a) + len(pair.b) <= max_len - 3


def test_true_next_continues_and_negatives_come_from_other_documents():
    pairs = all_pairs(make_docs(), max_seq_len=64)
    labels = [p.label for _, p in pairs]
    assert 0.35 < labels.count(NOT_NEXT) / len(labels) < 0.65
    for doc, pair in pairs:
        assert {source(t)[0] for t in pair.a} == {doc}
        b_docs = {source(t)[0] for t in pair.b}
        if pair.label == IS_NEXT:
            assert b_docs == {doc}
            assert source(pair.b[0])[1] == source(pair.a[-1])[1] + 1  # B starts where A ends
        else:
            assert doc not in b_docs


def test_unused_sentences_are_put_back():
    """Without truncation every sentence of a document is used, as A or as a true B."""
    docs = make_docs(n_docs=10, sentences=15, length=4)
    used = {d: set() for d in range(len(docs))}
    for doc, pair in all_pairs(docs, max_seq_len=200, short_seq_prob=0.0):
        used[doc] |= {source(t)[1] for t in pair.a}
        if pair.label == IS_NEXT:
            used[doc] |= {source(t)[1] for t in pair.b}
    assert all(used[d] == set(range(15)) for d in used)


def test_sentence_pairs_are_one_sentence_each_and_ask_the_nsp_question():
    """With sentence_pair_prob 1 every pair is two whole sentences: the next one of the same
    document (IS_NEXT) or any one of another document, about half and half."""
    docs = make_docs()
    rng = random.Random(0)
    pairs = [
        (i, p) for i in range(len(docs)) for p in pairs_from_document(docs, i, 64, 0.1, rng, 1.0)
    ]
    assert len(pairs) == len(docs) * 11  # every sentence but a document's last is an A
    labels = [p.label for _, p in pairs]
    assert 0.4 < labels.count(NOT_NEXT) / len(labels) < 0.6
    for doc, pair in pairs:
        ((a_doc, a_sentence),) = {source(t) for t in pair.a}
        assert a_doc == doc and len(pair.a) == 6
        ((b_doc, b_sentence),) = {source(t) for t in pair.b}
        assert len(pair.b) == 6
        if pair.label == IS_NEXT:
            assert (b_doc, b_sentence) == (doc, a_sentence + 1)
        else:
            assert b_doc != doc


def test_sentence_pair_prob_mixes_and_zero_changes_nothing():
    docs = make_docs(n_docs=40)
    rng = random.Random(0)
    unasked = [
        (i, p) for i in range(len(docs)) for p in pairs_from_document(docs, i, 64, 0.1, rng, 0)
    ]
    assert unasked == all_pairs(docs)  # data prepared before the option existed stays the same
    rng = random.Random(0)
    counts = [len(pairs_from_document(docs, i, 64, 0.0, rng, 0.5)) for i in range(len(docs))]
    # a document cut into sentences gives 11 pairs; into segments of 61 tokens, a few
    assert set(counts) - {11} and max(set(counts) - {11}) <= 5
    assert 8 < counts.count(11) < 32


MASKING = MaskingConfig(
    cls_id=CLS,
    sep_id=SEP,
    mask_id=MASK,
    pad_id=PAD,
    vocab_size=VOCAB,
    max_seq_len=128,
    max_predictions=20,
)


def test_masking_80_10_10_within_statistical_bounds():
    rng = np.random.default_rng(0)
    masked = randomised = kept = 0
    for _ in range(3000):
        len_a = 60
        seq = np.concatenate([[CLS], np.arange(100, 160), [SEP], np.arange(200, 260), [SEP]])
        positions, labels, corrupted = mask_sequence(seq, len_a, MASKING, rng)
        assert len(positions) == round(120 * 0.15) == 18
        assert np.array_equal(labels, seq[positions])
        specials = {0, len_a + 1, len(seq) - 1}
        assert not specials & set(positions.tolist())  # [CLS]/[SEP] never selected
        unselected = np.setdiff1d(np.arange(len(seq)), positions)
        assert np.array_equal(corrupted[unselected], seq[unselected])
        new = corrupted[positions]
        masked += int((new == MASK).sum())
        kept += int((new == labels).sum())
        randomised += int(((new != MASK) & (new != labels)).sum())
    total = masked + kept + randomised
    # 54,000 draws: 3 standard deviations are about 0.5% for the 80% share, 0.4% for the 10% ones.
    assert abs(masked / total - 0.8) < 0.006
    assert abs(randomised / total - 0.1) < 0.005
    assert abs(kept / total - 0.1) < 0.005 + 1 / VOCAB  # a random token can hit the original


def test_shard_batches_segments_padding_and_dynamic_masks(tmp_path):
    from bertserve.model.training.data.pretraining import Pair

    pairs = [Pair([10, 11, 12], [20, 21], IS_NEXT), Pair([30] * 50, [40] * 40, NOT_NEXT)]
    write_pairs(pairs, tmp_path, VOCAB)
    config = MaskingConfig(
        cls_id=CLS,
        sep_id=SEP,
        mask_id=MASK,
        pad_id=PAD,
        vocab_size=VOCAB,
        max_seq_len=100,
        max_predictions=15,
    )
    shard = PairShard(tmp_path, config)
    batch = shard.batch([0, 1], seed=7, epoch=0)
    assert batch["input_ids"].shape == (2, 100)
    assert batch["token_type_ids"][0, :8].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert batch["attention_mask"][0].sum() == 8 and batch["attention_mask"][1].sum() == 93
    assert batch["input_ids"][0, 8:].tolist() == [PAD] * 92
    assert batch["next_sentence_label"].tolist() == [IS_NEXT, NOT_NEXT]
    assert (batch["mlm_labels"][0] != -100).sum() == 1  # 15% of 5 tokens, at least one
    assert (batch["mlm_labels"][1] != -100).sum() == 14  # round(0.15 * 90)
    again = shard.batch([0, 1], seed=7, epoch=0)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)  # resumable: same masks
    other = shard.batch([0, 1], seed=7, epoch=1)
    assert not np.array_equal(batch["mlm_positions"], other["mlm_positions"])  # redrawn


def test_vocabulary_too_large_for_uint16(tmp_path):
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_pairs([], tmp_path, 70000)
