"""The NSP-head stage: sentence pairs drawn as the evaluation draws them, from training documents
only, and a checkpoint that differs from its input in the pooler and NSP classifier alone."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_model
from model.training.__main__ import main
from model.training.data.wikipedia import is_heldout, read_documents
from model.training.nsp_head import sentence_pairs, unchanged_outside_head

FIXTURE = Path(__file__).parents[1] / "fixtures" / "wiki"


def test_sentence_pairs_alternate_next_and_another_document():
    docs = [[f"d{d} s{i}" for i in range(5)] for d in range(3)]
    pairs, labels = sentence_pairs(docs, 400, random.Random(0))
    assert labels == [0, 1] * 200
    for (a, b), label in zip(pairs, labels, strict=True):
        doc_a, sent_a = a.split()
        doc_b, sent_b = b.split()
        if label == 0:
            assert doc_a == doc_b and int(sent_b[1:]) == int(sent_a[1:]) + 1
        else:
            assert doc_a != doc_b


@pytest.mark.slow
def test_nsp_head_changes_only_the_head(checkpoints, tmp_path):
    ckpt = checkpoints["BertForPreTraining"]
    out = tmp_path / "out"
    args = ["nsp-head", "--checkpoint", str(ckpt), "--data", str(FIXTURE), "--out", str(out)]
    assert main([*args, "--pairs", "400", "--threads", "1"]) == 0
    before, after = load_model(ckpt), load_model(out)
    assert unchanged_outside_head(before, after)
    summary = json.loads((out / "nsp_head.json").read_text())
    assert summary["dev_accuracy"] >= summary["dev_accuracy_before"]
    assert summary["training_documents"] > 0 and len(summary["history"]) == 20
    if summary["dev_accuracy"] > summary["dev_accuracy_before"]:  # the kept epoch was trained
        head = "cls.seq_relationship.weight"
        assert not torch.equal(before.state_dict()[head], after.state_dict()[head])
    # the evaluation's documents are not trained on: every one it would use is held out
    docs = list(read_documents(FIXTURE))
    assert any(not is_heldout(d.id, 0.02) for d in docs)
