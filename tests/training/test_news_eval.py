"""Fill-mask and NSP measured on news: CoNLL-2003's Reuters stories read as documents, scored
through the served code like the held-out Wikipedia figures."""

from __future__ import annotations

import pytest

from bertserve.model.training.data.tasks import read_conll_documents
from bertserve.model.training.evaluate import NEWS, evaluate

STORIES = [
    ["the king was born in paris", "the queen was born in london", "a good year", "the end"],
    ["the fox and the dog", "the film was dull", "the river of the city", "who was first"],
    ["a great film", "a bad movie", "the first year", "what a year"],
]


def write_news(directory, stories=STORIES, split="eng.testb"):
    """A CoNLL-2003 file (eng.testb unless `split` says) as CoNLL writes it: -DOCSTART- before
    each story, a word a line, a blank line after each sentence."""
    directory.mkdir()
    lines = []
    for story in stories:
        lines += ["-DOCSTART- -X- -X- O", ""]
        for sentence in story:
            lines += [f"{w} X X O" for w in sentence.split()] + [""]
    (directory / split).write_text("\n".join(lines) + "\n")
    return directory


def test_conll_is_read_as_stories_of_sentences(tmp_path):
    assert read_conll_documents(write_news(tmp_path / "conll2003"), "test") == STORIES


def test_news_pairs_and_masked_news_words_are_scored_through_the_served_code(bundle_dir, tmp_path):
    data = write_news(tmp_path / "conll2003")
    nsp = evaluate("nsp-news", bundle_dir / "pretrained", data)
    assert nsp["pairs"] == 2000 and 0 <= nsp["nsp_accuracy"] <= 100 and nsp["data"] == NEWS
    mlm = evaluate("mlm-news", bundle_dir / "pretrained", data)
    # Sentences of 6-60 words with a whole in-vocabulary word of 3+ letters: the first story's
    # first two.
    assert mlm["sentences"] == 2 and 0 <= mlm["mlm_word_accuracy"] <= 100
    with pytest.raises(ValueError, match="serves"):
        evaluate("nsp-news", bundle_dir / "sentiment", data)
