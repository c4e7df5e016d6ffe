"""`soup`: the mean of fine-tuned checkpoints of one start, refused across shapes or starts."""

from __future__ import annotations

import json

import pytest
import torch

from bertserve.export.bundle import build_bundle
from bertserve.model.checkpoint import load_model, save_model
from bertserve.model.heads import BertForSequenceClassification
from bertserve.model.sources import Provenance, read_soup, write_provenance
from bertserve.model.training.__main__ import main
from bertserve.model.training.soup import soup
from tests.helpers.checkpoints import write_vocab

START = Provenance("tiny", "tests", "apache-2.0", "0" * 64)


def ingredient(path, config, seed, start=START):
    torch.manual_seed(seed)
    save_model(BertForSequenceClassification(config), path)
    write_provenance(path, start)
    write_vocab(path / "vocab.txt")
    return path


def test_soup_is_the_mean_of_its_ingredients(tmp_path, tiny_config, capsys):
    a = ingredient(tmp_path / "a", tiny_config, 1)
    b = ingredient(tmp_path / "b", tiny_config.replace(hidden_dropout_prob=0.3), 2)
    out = tmp_path / "soup"
    assert main(["soup", "--out", str(out), str(a), str(b)]) == 0
    recorded = json.loads(capsys.readouterr().out)
    assert [i["checkpoint"] for i in recorded["ingredients"]] == [str(a), str(b)]
    mean, sa, sb = (load_model(p).state_dict() for p in (out, a, b))
    for key in ("bert.embeddings.word_embeddings.weight", "classifier.weight"):
        assert torch.allclose(mean[key], (sa[key] + sb[key]) / 2, atol=1e-7)
    assert json.loads((out / "source.json").read_text())["name"] == "tiny"
    assert read_soup(out) == recorded["ingredients"] and read_soup(a) is None
    bundle = build_bundle(out, ["classify"], tmp_path / "bundle")
    assert bundle.source.soup == recorded["ingredients"]  # bundle.json names the ingredients


def test_soup_refuses_what_cannot_be_averaged(tmp_path, tiny_config):
    a = ingredient(tmp_path / "a", tiny_config, 1)
    wide = ingredient(tmp_path / "w", tiny_config.replace(intermediate_size=40), 2)
    with pytest.raises(ValueError, match="differs from .* in intermediate_size: 40 vs 37"):
        soup([a, wide], tmp_path / "out")
    other = ingredient(tmp_path / "o", tiny_config, 3, Provenance("x", "y", "mit", "1" * 64))
    with pytest.raises(ValueError, match="other published weights"):
        soup([a, other], tmp_path / "out")
    with pytest.raises(ValueError, match="two or more"):
        soup([a], tmp_path / "out")
