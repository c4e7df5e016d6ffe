"""Helpers the tasks share."""

from __future__ import annotations

import numpy as np
import pytest

from bertserve.runtime.tasks.common import TaskContext, top_k_indices


@pytest.mark.parametrize("k", [1, 5, 16, 17, 40])
def test_top_k_is_a_stable_descending_sorts_first_k(k):
    """Largest first, equal values in index order, for the argmax passes (k <= 16) and the sort
    alike; values with many ties (rounded) and without."""
    rng = np.random.default_rng(k)
    for values in (rng.random(3000), np.round(rng.random(3000), 2), rng.random(7)):
        expected = np.argsort(-values, kind="stable")[:k]
        got = top_k_indices(values, k)
        assert got.tolist() == expected.tolist()
    assert top_k_indices(np.float32([0.5, 0.25]), 1).tolist() == [0]


@pytest.mark.parametrize("lowercase", [True, False])
def test_max_pieces_bounds_the_pieces_of_any_text(lowercase):
    """/qa skips counting a context's pieces when this bound is within the window limit, so it
    must never be below the real count: accents (decomposed), CJK (spaced), ligatures, emoji,
    unknown long words, punctuation runs, control characters."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    from tests.conftest import BERT_VOCAB

    wordpiece = BertWordPieceTokenizer(str(BERT_VOCAB), lowercase=lowercase)
    ctx = TaskContext(None, Tokenizer.from_str(wordpiece.to_str()), "", 10_000)
    texts = [
        "Aristotle was born in Stagira in 384 BC.",
        "Ångström, naïve café, Ελληνικά, İstanbul, ǅemal",
        "東京は日本の首都です。北京 한국어 텍스트",
        "ﬁnance ﬂow ½ ™ ℌ 🙂🙂🙂 \u200b\u0301\u0301",
        "x" * 150 + " " + "!?" * 40 + " a\tb\nc\x00d\x7f",
        "".join(chr(c) for c in range(0x1100, 0x1200)) + " 가각간갇",
    ]
    for text in texts:
        pieces = len(ctx.tokenizer.encode(text, add_special_tokens=False).ids)
        assert ctx.max_pieces(text) >= pieces, text


def test_truncation_matches_the_tokenizers_longest_first_without_its_overflow(bundle_dir):
    """`TaskContext.truncated` keeps exactly what tokenizers' own longest_first keeps (ids and
    segments), for single texts and pairs, while the library's pair truncation enumerates
    every overflow combination; a 2 x 100k-character pair stays one short encoding."""
    import random

    from tokenizers import Tokenizer

    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.tasks.common import TaskContext

    bundle = bundle_dir / "pretrained"
    spec = load_bundle_spec(bundle)
    rng = random.Random(0)
    words = [
        "the",
        "a",
        "cat",
        "sat",
        "on",
        "mat",
        "unbelievable",
        "xylophoneously",
        ",",
        ".",
        "paris",
        "café",
        "naïve",
        "Über",
    ]
    for i in range(300):
        max_len = rng.randint(8, 60)
        ctx = TaskContext.load(bundle, spec.model_copy(update={"max_seq_len": max_len}), 10**6)
        library = Tokenizer.from_str(ctx.tokenizer_json)
        library.no_padding()
        library.enable_truncation(max_len, strategy="longest_first")
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        pair = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) if i % 3 else None
        want, got = library.encode(text, pair), ctx.truncated(text, pair)
        assert (got.ids, got.type_ids) == (want.ids, want.type_ids), (max_len, text, pair)
    long = ctx.truncated("a." * 50_000, "b." * 50_000)
    assert len(long.ids) == ctx.max_len and len(long.overflowing) <= 4


def test_ner_refuses_from_a_text_start_only_what_the_whole_text_would_need(bundle_dir):
    """/ner refuses a long text from the pieces of its start (less a cut word's) when those
    alone need more windows than are left: never a text whose exact count fits."""
    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.tasks import ner
    from bertserve.runtime.tasks.common import TaskContext
    from bertserve.service.http.errors import TooLarge

    bundle = bundle_dir / "entities"
    ctx = TaskContext.load(bundle, load_bundle_spec(bundle), 10**6, max_rows=4)
    size = ctx.max_len - 2
    for unit in ("a.", "the king of france . ", "unbelievably "):
        for repeat in range(1, 600, 37):
            text = unit * repeat
            pieces = len(ctx.tokenizer.encode(text, add_special_tokens=False))
            fits = len(ner.windows_for(pieces, size, min(32, size // 2))) <= 4
            try:
                ner.preprocess(ctx, [text], 32)
                assert fits, (unit, repeat)
            except TooLarge:
                assert not fits, (unit, repeat)


def test_a_prompt_goes_before_the_text_and_the_default_applies_unasked():
    from types import SimpleNamespace

    from bertserve.runtime.errors import InvalidInput
    from bertserve.runtime.tasks.embed import prompted

    spec = SimpleNamespace(
        name="e5", prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name=None
    )
    ctx = SimpleNamespace(spec=spec)
    assert prompted(ctx, None, "rivers") == "rivers"
    assert prompted(ctx, "query", "rivers") == "query: rivers"
    spec.default_prompt_name = "passage"
    assert prompted(ctx, None, "rivers") == "passage: rivers"
    with pytest.raises(InvalidInput, match=r"has prompts \['passage', 'query'\]"):
        prompted(ctx, "title", "rivers")


def test_a_long_question_is_cut_at_a_piece_boundary_to_the_limit():
    """/qa cuts a question past max_question_len (or half the window) to its first pieces, as
    BERT's SQuAD code does, rather than refusing it: a schema cannot state a length in tokens."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    from bertserve.runtime.tasks.qa import cut_question
    from tests.conftest import BERT_VOCAB

    wordpiece = BertWordPieceTokenizer(str(BERT_VOCAB), lowercase=True)
    ctx = TaskContext(None, Tokenizer.from_str(wordpiece.to_str()), "", 10_000)
    question = "who was the unaffable king of france in the year 1066 ?"
    pieces = ctx.tokenizer.encode(question, add_special_tokens=False).tokens
    assert cut_question(ctx, question, 100) == (question, len(pieces))
    for most in range(1, len(pieces)):
        cut, n = cut_question(ctx, question, most)
        assert n == most and question.startswith(cut)
        assert ctx.tokenizer.encode(cut, add_special_tokens=False).tokens == pieces[:most]


@pytest.mark.parametrize("direction", ["Right", "Left"])
def test_a_long_query_cut_once_pairs_as_the_whole_query_would(bundle_dir, direction):
    """/rerank encodes an over-long query once instead of again beside each document
    (`TaskContext.truncated(first=...)`): every pair it makes is the pair the whole query
    would make, cut from either end."""
    import random

    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.tasks.rerank import pair_rows

    bundle = bundle_dir / "pretrained"
    ctx = TaskContext.load(bundle, load_bundle_spec(bundle), 10**6)
    rng = random.Random(1)
    words = ["the", "king", "unbelievable", "xylophoneously", "of", "france", "!", "café"]
    for _ in range(40):
        query = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3 * ctx.max_len)))
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 200))) for _ in range(3)]
        rows, _ = pair_rows(ctx, query, docs, "truncate", direction)
        for got, doc in zip(rows, docs, strict=True):
            want = ctx.encode(query, doc, truncate=True, direction=direction)
            assert got.input_ids.tolist() == want.ids, (query, doc)


def test_ids_framed_by_the_tokenizer_lose_the_frame_once():
    from bertserve.runtime.tasks.common import unframed

    assert unframed([101, 7, 8, 102], [101], [102]) == [7, 8]
    assert unframed([101, 7, 102, 8, 102], [101], [102]) == [7, 102, 8]  # a pair: as sent
    assert unframed([7, 8], [101], [102]) == [7, 8]  # bare: the service frames them
    assert unframed([101, 7, 8], [101], [102]) == [101, 7, 8]  # half a frame is no frame
    assert unframed([0, 7, 2], [0], [2]) == [7]  # RoBERTa's <s> ... </s>
    assert unframed([7, 102], [], [102]) == [7]
