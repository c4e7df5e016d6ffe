from __future__ import annotations

from pathlib import Path

from bertserve.model.training.data.wikipedia import (
    is_heading,
    is_heldout,
    read_documents,
    split_sentences,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "wiki"


def test_documents_sentences_and_stubs():
    docs = list(read_documents(FIXTURE))
    raw = (FIXTURE / "wiki_00").read_text().count("<doc ")
    assert raw == 16
    assert 0 < len(docs) < raw  # stubs dropped
    for doc in docs:
        assert doc.title and doc.paragraphs
        assert all(doc.sentences)
        assert not any(is_heading(" ".join(paragraph)) for paragraph in doc.paragraphs)
    assert list(read_documents(FIXTURE, max_docs=3)) == docs[:3]


def test_sentence_splitter_and_headings():
    assert split_sentences("Dr. Smith went to Washington. He arrived at 5 p.m. on Monday.") == [
        "Dr. Smith went to Washington.",
        "He arrived at 5 p.m. on Monday.",
    ]
    assert is_heading("Etymology and terminology.")
    assert not is_heading("Anarchism holds the state to be undesirable, unnecessary, or harmful.")


def test_heldout_split_is_stable_and_sized():
    ids = [str(i) for i in range(20000)]
    held = [i for i in ids if is_heldout(i, 0.02)]
    assert 300 < len(held) < 500
    assert held == [i for i in ids if is_heldout(i, 0.02)]
