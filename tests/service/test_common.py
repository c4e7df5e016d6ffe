"""Helpers the tasks share."""

from __future__ import annotations

import numpy as np
import pytest

from service.tasks.common import TaskContext, top_k_indices


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
