"""Fine-tuning data and metrics: NER label alignment, IOB1 -> BIO, SQuAD windows round-trip every
answer, span decoding invariants, and the metric functions against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.data import tasks as data
from bertserve.model.training.metrics import (
    entity_f1,
    exact_match,
    normalize_answer,
    squad_scores,
    token_f1,
)
from bertserve.runtime.encoding import (
    CASE_MIXED,
    CASE_NONE,
    CASE_OR_UNKNOWN,
    CASE_TITLE,
    CASE_UNKNOWN,
    CASE_UPPER,
    case_type,
    case_type_ids,
)
from bertserve.runtime.tasks.ner import piece_is_subword
from bertserve.runtime.tasks.qa import decode_spans
from tests.conftest import BERT_VOCAB, shared_data


@pytest.fixture(scope="module")
def tok():
    return BertTokenizer.from_vocab(BERT_VOCAB)


def test_iob1_to_bio():
    assert data.iob1_to_bio(["I-ORG", "O", "I-MISC", "I-MISC", "B-MISC", "I-PER", "I-LOC"]) == [
        "B-ORG",
        "O",
        "B-MISC",
        "I-MISC",
        "B-MISC",
        "B-PER",
        "B-LOC",
    ]


def test_ner_labels_go_on_every_piece_the_served_aggregation_reads_as_a_word(tok):
    """A CoNLL word that /ner's aggregation splits at punctuation ("U.S." -> u . s .) is
    labelled on each part: B on the first, I on the rest of the same entity, O stays O; a word's
    "##" continuations stay unlabelled, as "first" aggregation never reads them."""
    words = ["Unaffable", "U.S.", "1996-08-22", "(", "Reuters", ")", "don't", "AL-AIN"]
    tags = ["B-PER", "B-LOC", "O", "O", "B-ORG", "O", "O", "I-LOC"]
    label2id = {t: i for i, t in enumerate(data.CONLL_LABELS)}
    ids, labels, types = data.align_labels(tok, words, tags, label2id, 128)
    assert types == [0] * len(ids)
    pieces = tok.convert_ids_to_tokens(ids)
    labelled = [
        (p, data.CONLL_LABELS[lab])
        for p, lab in zip(pieces, labels, strict=True)
        if lab != data.IGNORE
    ]
    assert labelled == [
        ("una", "B-PER"),
        ("u", "B-LOC"),
        (".", "I-LOC"),
        ("s", "I-LOC"),
        (".", "I-LOC"),
        *[(p, "O") for p in ("1996", "-", "08", "-", "22", "(")],
        ("reuters", "B-ORG"),
        (")", "O"),
        ("don", "O"),
        ("'", "O"),
        ("t", "O"),
        ("al", "I-LOC"),
        ("-", "I-LOC"),
        ("ain", "I-LOC"),
    ]
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"
    assert labels[0] == labels[-1] == data.IGNORE
    # exactly the pieces the served aggregation reads as words carry a label
    text = " ".join(words)
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    served = [
        not piece_is_subword(True, t, text, s, e, i == tok.unk_id)
        for i, t, (s, e) in zip(enc.ids, enc.tokens, enc.offsets, strict=True)
    ]
    assert [lab != data.IGNORE for lab in labels[1:-1]] == served
    cut_ids, cut_labels, _ = data.align_labels(tok, words, tags, label2id, 8)
    assert len(cut_ids) == 8 and cut_ids[-1] == tok.sep_id and cut_labels[-1] == data.IGNORE


def test_case_types_of_pre_split_words_match_what_the_service_sends(tok):
    """Training sees each piece's letter case as segment ids exactly as /ner computes them
    from the joined text's offsets, so the model is served what it learnt."""
    words = ["McDonald", "'s", "BBC", "reporter", "met", "Angela", "in", "U.S.", "1996", "I"]
    tags = ["O"] * len(words)
    label2id = {t: i for i, t in enumerate(data.CONLL_LABELS)}
    ids, _, types = data.align_labels(tok, words, tags, label2id, 128, case_types=True)
    text = " ".join(words)
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    assert ids[1:-1] == enc.ids
    assert types[1:-1] == case_type_ids(text, enc.offsets)
    assert types[0] == types[-1] == 0  # [CLS], [SEP]
    shapes = dict(zip(tok.convert_ids_to_tokens(ids), types, strict=True))
    assert shapes["bbc"] == CASE_UPPER and shapes["angela"] == CASE_TITLE
    assert shapes["reporter"] == shapes["1996"] == CASE_NONE and shapes["i"] == CASE_TITLE


def test_case_scheme_2_marks_a_text_without_capitals_as_unknown(tok):
    """Scheme 2: a sentence with no capital anywhere (typed in lower case) is all CASE_UNKNOWN,
    in training as on /ner; a sentence with one capital keeps every piece's case, its
    lower-case words CASE_NONE, the cue "no capital here" kept clean."""
    label2id = {t: i for i, t in enumerate(data.CONLL_LABELS)}
    for words, unknown in (
        (["angela", "met", "the", "bbc"], True),
        (["Angela", "met", "the", "bbc"], False),
    ):
        _, _, types = data.align_labels(
            tok, words, ["O"] * 4, label2id, 128, case_types=CASE_OR_UNKNOWN
        )
        text = " ".join(words)
        enc = tok.tokenizer.encode(text, add_special_tokens=False)
        served = case_type_ids(text, enc.offsets, CASE_OR_UNKNOWN)
        assert types[1:-1] == served and types[0] == types[-1] == 0
        if unknown:
            assert set(served) == {CASE_UNKNOWN}
        else:
            assert served[0] == CASE_TITLE and CASE_UNKNOWN not in served
            assert served == case_type_ids(text, enc.offsets)  # scheme 1 where case is known


@pytest.mark.parametrize(
    ("piece", "shape"),
    [
        ("paris", CASE_NONE),
        ("1996-08-22", CASE_NONE),
        (",", CASE_NONE),
        ("Paris", CASE_TITLE),
        ("I", CASE_TITLE),
        ("BBC", CASE_UPPER),
        ("U.S.", CASE_UPPER),
        ("iPhone", CASE_MIXED),
        ("McDonald", CASE_MIXED),
        ("Élysée", CASE_TITLE),
    ],
)
def test_case_type(piece, shape):
    assert case_type(piece) == shape


def test_squad_windows_round_trip_every_answer_that_fits(tok):
    examples = data.read_squad(shared_data("squad-v1.1"), "train")[:400]
    found = 0
    for example in examples:
        for max_len, stride in ((384, 128), (128, 32)):
            features = data.qa_features(tok, example, max_len, stride)
            assert all(len(f.input_ids) <= max_len for f in features)
            hits = [f for f in features if f.start > 0]
            answer = example.answers[0]
            if len(tok.encode(answer).input_ids) < max_len // 3:
                assert hits, (example.id, max_len)  # a short answer fits some window
            for f in hits:
                assert 0 < f.start <= f.end < len(f.input_ids)
            found += len(hits)
    assert found > 400


def test_squad_answer_spans_decode_to_the_answer(tok):
    examples = data.read_squad(shared_data("squad-v1.1"), "train")[:300]
    for example in examples:
        tok.tokenizer.enable_truncation(128, stride=32, strategy="only_second")
        first = tok.tokenizer.encode(example.question, example.context)
        tok.tokenizer.no_truncation()
        windows = [first, *first.overflowing]
        for enc, f in zip(windows, data.qa_features(tok, example, 128, 32), strict=True):
            if f.start:
                text = example.context[enc.offsets[f.start][0] : enc.offsets[f.end][1]]
                assert normalize_answer(example.answers[0]) in normalize_answer(text)


def test_span_decoding_invariants():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(5, 60))
        allowed = rng.random(n) < 0.6
        allowed[0] = True
        start, end = rng.random(n) * allowed, rng.random(n) * allowed
        max_len = int(rng.integers(1, 20))
        starts, ends, scores = decode_spans(start, end, int(rng.integers(1, 8)), max_len, allowed)
        assert np.all(ends >= starts)
        assert np.all(ends - starts < max_len)
        assert np.all(allowed[starts]) and np.all(allowed[ends])
        assert np.all(np.diff(scores) <= 1e-12)  # best first


def test_band_decoding_equals_the_pipelines_full_matrix():
    from bertserve.runtime.tasks.qa import _decode_full

    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 300))
        allowed = rng.random(n) < rng.uniform(0.05, 0.9)
        allowed[0] = True
        start = np.where(allowed, rng.random(n), 0.0)
        end = np.where(allowed, rng.random(n), 0.0)
        start[0] = end[0] = 0.0  # [CLS], as postprocess leaves it
        max_len, top_k = int(rng.integers(1, 30)), int(rng.integers(1, 25))
        fast = decode_spans(start, end, top_k, max_len, allowed)
        full = _decode_full(start, end, top_k, max_len, allowed)
        for a, b in zip(fast, full, strict=True):
            np.testing.assert_array_equal(a, b)


def test_squad_official_normalisation_and_scores():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear and THE plum.") == "apple pear and plum"
    assert exact_match("the Broncos", "Broncos") == 1.0
    assert token_f1("Denver Broncos won", "the Denver Broncos") == pytest.approx(0.8)
    assert token_f1("Carolina", "Denver Broncos") == 0.0
    scores = squad_scores(
        ["Denver Broncos", "Carolina Panthers", "1990"],
        [["Denver Broncos", "Broncos"], ["Panthers"], ["1990s", "in 1990"]],
    )
    assert scores["exact_match"] == pytest.approx(100 / 3)  # "in 1990" is not "1990"
    two_thirds = 2 * 0.5 * 1 / 1.5  # one of two predicted tokens, the whole reference
    assert scores["f1"] == pytest.approx(100 * (1 + two_thirds + two_thirds) / 3)


def test_entity_f1_exact_spans():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]
    result = entity_f1(gold, pred)  # 2 of 3 predicted right, 2 of 3 gold found
    assert result["precision"] == pytest.approx(200 / 3)
    assert result["recall"] == pytest.approx(200 / 3)
    assert entity_f1([["B-PER", "I-PER"]], [["B-PER", "O"]])["f1"] == 0.0  # partial span = miss


def test_case_dropout_blanks_the_case_of_a_share_of_rows():
    from bertserve.model.training.finetune import Features, drop_case

    rows = [[0, 2, 3, 0]] * 1000
    features = Features([[1, 2, 3, 4]] * 1000, [list(r) for r in rows], {"labels": [0] * 1000})
    dropped = drop_case(features, 0.15, seed=1)
    blank = sum(t == [0, 0, 0, 0] for t in features.token_type_ids)
    assert blank == dropped and 100 < dropped < 200  # about 15%, drawn with the seed
    again = Features([[1, 2, 3, 4]] * 1000, [list(r) for r in rows], {"labels": [0] * 1000})
    assert (
        drop_case(again, 0.15, seed=1) == dropped
        and again.token_type_ids == features.token_type_ids
    )
    with pytest.raises(ValueError, match="case_dropout must be in"):
        drop_case(again, 1.5, seed=1)
    # scheme 2: the dropped rows read as a text without capitals does on /ner, [CLS] and [SEP] 0
    unknown = Features([[1, 2, 3, 4]] * 1000, [list(r) for r in rows], {"labels": [0] * 1000})
    assert drop_case(unknown, 0.15, seed=1, scheme=CASE_OR_UNKNOWN) == dropped
    marked = [
        i for i, t in enumerate(unknown.token_type_ids) if t == [0, CASE_UNKNOWN, CASE_UNKNOWN, 0]
    ]
    assert marked == [i for i, t in enumerate(features.token_type_ids) if t == [0, 0, 0, 0]]
