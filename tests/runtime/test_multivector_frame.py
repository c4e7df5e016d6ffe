"""ColBERT framing (runtime/tasks/multivector.py), the one the service and the trainer share:
PyLate's `ColBERT.tokenize` in ids. The end-to-end parity with PyLate itself is
tests/service/test_multivector.py; these pin the rules one at a time."""

from __future__ import annotations

import numpy as np

from bertserve.runtime.bundle import MultiVectorSpec
from bertserve.runtime.tasks.multivector import frame, kept, maxsim

CLS, SEP, MASK, Q, D = 101, 102, 103, 1, 2
SPEC = MultiVectorSpec(
    dim=4,
    query_prefix_id=Q,
    document_prefix_id=D,
    query_length=8,
    document_length=6,
    expansion_id=MASK,
    skip_ids=[1010],  # ","
)


def test_a_query_gets_its_marker_and_unattended_mask_expansion():
    ids, attended = frame([CLS, 7, 8, SEP], True, SPEC)
    assert ids.tolist() == [CLS, Q, 7, 8, SEP, MASK, MASK, MASK]
    assert attended == 5  # the [MASK]s are read, not attended to
    assert kept(ids, attended, True, SPEC).tolist() == list(range(8))  # every position scores


def test_attended_expansion_attends_every_position():
    spec = SPEC.model_copy(update={"attend_to_expansion": True})
    ids, attended = frame([CLS, 7, SEP], True, spec)
    assert len(ids) == attended == 8


def test_a_query_without_expansion_or_marker_is_its_tokens():
    spec = SPEC.model_copy(update={"query_expansion": False, "query_prefix_id": None})
    ids, attended = frame([CLS, 7, 8, SEP], True, spec)
    assert ids.tolist() == [CLS, 7, 8, SEP] and attended == 4
    assert kept(ids, attended, True, spec).tolist() == [0, 1, 2, 3]


def test_a_long_text_is_cut_keeping_its_closing_token():
    ids, attended = frame([CLS, 7, 8, 9, 10, 11, 12, SEP], False, SPEC)
    assert ids.tolist() == [CLS, D, 7, 8, 9, SEP]  # 6 positions, the marker counted
    assert attended == 6
    query, _ = frame([CLS, *range(20, 40), SEP], True, SPEC)
    assert query.tolist() == [CLS, Q, 20, 21, 22, 23, 24, SEP]


def test_a_documents_skiplist_tokens_do_not_score():
    ids, attended = frame([CLS, 7, 1010, 8, SEP], False, SPEC)
    assert kept(ids, attended, False, SPEC).tolist() == [0, 1, 2, 4, 5]


def test_maxsim_sums_each_query_vectors_best_match():
    query = np.asarray([[1.0, 0.0], [0.0, 1.0]])
    document = np.asarray([[0.6, 0.8], [1.0, 0.0]])
    assert maxsim(query, document) == 1.0 + 0.8
