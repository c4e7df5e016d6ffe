"""WordPiece through `tokenizers`: parity with BertTokenizerFast, training, offsets, truncation."""

from __future__ import annotations

import csv
import json

import pytest
import transformers

from bertserve.model.tokenizer import SPECIAL_TOKENS, BertTokenizer
from tests.conftest import BERT_VOCAB, shared_data


def sst2_dev_sentences(n):
    with open(shared_data("sst2", "dev.tsv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"] for r in rows[:n]]


def squad_dev_pairs(n):
    data = json.loads(shared_data("squad-v1.1", "dev-v1.1.json").read_text(encoding="utf-8"))
    pairs = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            pairs.append((paragraph["qas"][0]["question"], paragraph["context"]))
            if len(pairs) == n:
                return pairs
    return pairs


@pytest.fixture(scope="module")
def reference():
    vocab = BERT_VOCAB
    return BertTokenizer.from_vocab(vocab), transformers.BertTokenizerFast(vocab_file=str(vocab))


def test_casing_is_read_off_the_vocabulary(reference):
    ours, _ = reference
    assert ours.lowercase is True
    assert ours.vocab_size == 30522
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (
        0,
        100,
        101,
        102,
        103,
    )


def test_ids_and_offsets_equal_bert_tokenizer_fast_on_sst2(reference):
    ours, theirs = reference
    sentences = sst2_dev_sentences(500)
    assert len(sentences) == 500
    expected = theirs(sentences, return_offsets_mapping=True, return_token_type_ids=True)
    got = ours.encode_batch(sentences)
    for i, enc in enumerate(got):
        assert enc.input_ids == expected["input_ids"][i], sentences[i]
        assert enc.offsets == [tuple(o) for o in expected["offset_mapping"][i]], sentences[i]


def test_pairs_equal_bert_tokenizer_fast_on_squad(reference):
    ours, theirs = reference
    pairs = squad_dev_pairs(100)
    questions, contexts = zip(*pairs, strict=True)
    got = ours.encode_batch(contexts)
    expected = theirs(list(contexts), return_offsets_mapping=True)
    for i, enc in enumerate(got):
        assert enc.input_ids == expected["input_ids"][i]
        assert enc.offsets == [tuple(o) for o in expected["offset_mapping"][i]]
    got = ours.encode_batch(questions, contexts, max_length=384, truncation="only_second")
    expected = theirs(
        list(questions),
        list(contexts),
        max_length=384,
        truncation="only_second",
        return_offsets_mapping=True,
        return_token_type_ids=True,
    )
    for i, enc in enumerate(got):
        assert enc.input_ids == expected["input_ids"][i]
        assert enc.token_type_ids == expected["token_type_ids"][i]
        assert enc.offsets == [tuple(o) for o in expected["offset_mapping"][i]]


CORPUS = [
    "The Quick brown fox jumps over the lazy dog.",
    "Anarchism is a political philosophy that advocates stateless societies.",
    "In 1997, Apple Computer bought NeXT for $429 million.",
    "Aristotle was a Greek philosopher and scientist born in Stagira.",
] * 50


@pytest.mark.parametrize("lowercase", [False, True])
def test_train_save_and_load(tmp_path, lowercase):
    tok = BertTokenizer.train(texts=CORPUS, vocab_size=200, lowercase=lowercase, min_frequency=1)
    assert [tok.tokenizer.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    tok.save(tmp_path)
    for loaded in (BertTokenizer.load(tmp_path), BertTokenizer.from_vocab(tmp_path / "vocab.txt")):
        assert loaded.lowercase is lowercase
        text = "The Quick fox bought NeXT."
        assert loaded.encode(text).input_ids == tok.encode(text).input_ids
    enc = tok.encode("The Quick fox")
    assert enc.tokens[0] == "[CLS]" and enc.tokens[-1] == "[SEP]"
    assert ("quick" in enc.tokens) is lowercase


def test_pair_segments_and_offsets(reference):
    ours, _ = reference
    text, pair = "Hello, World!", "Is it me?"
    enc = ours.encode(text, pair)
    assert enc.tokens == [
        "[CLS]",
        "hello",
        ",",
        "world",
        "!",
        "[SEP]",
        "is",
        "it",
        "me",
        "?",
        "[SEP]",
    ]
    assert enc.token_type_ids == [0] * 6 + [1] * 5
    assert enc.sequence_ids == [None, 0, 0, 0, 0, None, 1, 1, 1, 1, None]
    for token, (start, end), seq in zip(enc.tokens, enc.offsets, enc.sequence_ids, strict=True):
        if seq is not None:
            assert [text, pair][seq][start:end].lower() == token


def test_truncation_strategies(reference):
    ours, _ = reference
    a, b = "one two three four five six", "seven eight"
    assert len(ours.encode(a, b, max_length=8).input_ids) == 8
    only_first = ours.encode(a, b, max_length=8, truncation="only_first")
    assert only_first.tokens[-3:] == ["seven", "eight", "[SEP]"]
    longest = ours.encode(a, b, max_length=8, truncation="longest_first")
    assert longest.tokens == ["[CLS]", "one", "two", "three", "[SEP]", "seven", "eight", "[SEP]"]
    with pytest.raises(ValueError, match="cannot encode within max_length=4"):
        ours.encode(a, b, max_length=4, truncation="only_second")
    with pytest.raises(ValueError, match="truncation 'middle'"):
        ours.encode(a, max_length=4, truncation="middle")
    assert len(ours.encode(a).input_ids) == 8  # truncation does not leak into the next call
