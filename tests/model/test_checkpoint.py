"""Checkpoints move both ways between our model and `transformers`, and bad ones fail clearly."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bertserve.model.checkpoint import CheckpointError, load_model, save_model
from bertserve.model.heads import (
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)

LAYER_KEYS = [
    "attention.self.query.weight",
    "attention.self.query.bias",
    "attention.self.key.weight",
    "attention.self.key.bias",
    "attention.self.value.weight",
    "attention.self.value.bias",
    "attention.output.dense.weight",
    "attention.output.dense.bias",
    "attention.output.LayerNorm.weight",
    "attention.output.LayerNorm.bias",
    "intermediate.dense.weight",
    "intermediate.dense.bias",
    "output.dense.weight",
    "output.dense.bias",
    "output.LayerNorm.weight",
    "output.LayerNorm.bias",
]
GOLDEN_PRETRAINING_KEYS = sorted(
    [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.bias",
        *(f"bert.encoder.layer.{i}.{k}" for i in range(2) for k in LAYER_KEYS),
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
        "cls.predictions.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
        "cls.seq_relationship.weight",
        "cls.seq_relationship.bias",
    ]
)

# Our class -> (transformers class, how to read its outputs, how to read ours)
PAIRS = {
    "BertForPreTraining": (
        transformers.BertForPreTraining,
        lambda o: (o.prediction_logits, o.seq_relationship_logits),
        lambda o: (o.mlm_logits, o.nsp_logits),
    ),
    "BertForSequenceClassification": (
        transformers.BertForSequenceClassification,
        lambda o: (o.logits,),
        lambda o: (o.logits,),
    ),
    "BertForTokenClassification": (
        transformers.BertForTokenClassification,
        lambda o: (o.logits,),
        lambda o: (o.logits,),
    ),
    "BertForQuestionAnswering": (
        transformers.BertForQuestionAnswering,
        lambda o: (o.start_logits, o.end_logits),
        lambda o: (o.start_logits, o.end_logits),
    ),
}


def config_for(name, config):
    """QA heads have two outputs (start, end); transformers sizes them by num_labels."""
    return (
        config.replace(id2label=None, label2id=None)
        if name == "BertForQuestionAnswering"
        else config
    )


def hf_config(config, act="gelu"):
    return transformers.BertConfig(**{**config.to_dict(), "hidden_act": act})


def assert_outputs_equal(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def valid_only(tensors, mask):
    """Compare per-token outputs only where attention_mask is 1 (padded rows are don't-care)."""
    return tuple(
        t[mask.bool()] if t.dim() >= 2 and t.shape[:2] == mask.shape else t for t in tensors
    )


def test_golden_state_dict_keys(tmp_path, tiny_config):
    path = save_model(BertForPreTraining(tiny_config), tmp_path)
    assert sorted(load_file(path)) == GOLDEN_PRETRAINING_KEYS
    heads = {
        BertForSequenceClassification: {"classifier.weight", "classifier.bias"},
        BertForTokenClassification: {"classifier.weight", "classifier.bias"},
        BertForQuestionAnswering: {"qa_outputs.weight", "qa_outputs.bias"},
    }
    body = {k for k in GOLDEN_PRETRAINING_KEYS if k.startswith("bert.")}
    for cls, head in heads.items():
        keys = set(cls(tiny_config).state_dict())
        pooler = {"bert.pooler.dense.weight", "bert.pooler.dense.bias"}
        expected = body | head if cls is BertForSequenceClassification else (body - pooler) | head
        assert keys == expected, cls.__name__


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_transformers_checkpoint_loads_into_ours(tmp_path, tiny_config, padded_batch, name, act):
    hf_cls, read_hf, read_ours = PAIRS[name]
    torch.manual_seed(0)
    theirs = hf_cls(hf_config(config_for(name, tiny_config), act)).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(tmp_path, name).eval()
    assert ours.config.hidden_act == act
    with torch.no_grad():
        expected = read_hf(theirs(**padded_batch))
        got = read_ours(ours(**padded_batch))
    mask = padded_batch["attention_mask"]
    assert_outputs_equal(valid_only(got, mask), valid_only(expected, mask))


@pytest.mark.parametrize("name", list(PAIRS))
def test_our_checkpoint_loads_into_transformers(tmp_path, tiny_config, padded_batch, name):
    hf_cls, read_hf, read_ours = PAIRS[name]
    torch.manual_seed(1)
    from bertserve.model.heads import HEADS

    ours = HEADS[name](config_for(name, tiny_config)).eval()
    save_model(ours, tmp_path)
    theirs = hf_cls.from_pretrained(tmp_path).eval()
    if name == "BertForPreTraining":
        assert (
            theirs.cls.predictions.decoder.weight is theirs.bert.embeddings.word_embeddings.weight
        )
    with torch.no_grad():
        expected = read_ours(ours(**padded_batch))
        got = read_hf(theirs(**padded_batch))
    mask = padded_batch["attention_mask"]
    assert_outputs_equal(valid_only(got, mask), valid_only(expected, mask))


def test_pytorch_bin_with_gamma_beta_and_a_bare_encoder(tmp_path, tiny_config, padded_batch):
    """Old-style checkpoints: pytorch_model.bin, LayerNorm gamma/beta, no `bert.` prefix."""
    torch.manual_seed(0)
    theirs = transformers.BertModel(hf_config(tiny_config)).eval()
    state = {}
    for key, value in theirs.state_dict().items():
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        )
        state[key] = value
    state["embeddings.position_ids"] = torch.arange(64)[None]
    torch.save(state, tmp_path / "pytorch_model.bin")
    hf_config(tiny_config).to_json_file(tmp_path / "config.json")
    ours = load_model(tmp_path, "BertModel").eval()
    with torch.no_grad():
        seq, pooled = ours(**padded_batch)
        ref = theirs(**padded_batch)
    mask = padded_batch["attention_mask"].bool()
    torch.testing.assert_close(seq[mask], ref.last_hidden_state[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, ref.pooler_output, atol=1e-5, rtol=1e-5)


def test_missing_head_is_initialised_and_logged(tmp_path, tiny_config, caplog):
    save_model(BertForPreTraining(tiny_config), tmp_path)
    with caplog.at_level(logging.INFO, logger="bertserve.model.checkpoint"):
        model = load_model(tmp_path, "BertForSequenceClassification")
    assert "initialised (not in the checkpoint): classifier.weight, classifier.bias" in caplog.text
    assert "dropped (another head's weights): cls." in caplog.text
    assert model.classifier.weight.shape == (3, 32)


def test_more_segment_ids_than_the_checkpoint_start_as_segment_0(tmp_path, tiny_config):
    """case_type_ids grows the segment table: the new rows copy row 0, so the grown model
    computes what the checkpoint did until training tells the segments apart."""
    save_model(BertForTokenClassification(tiny_config), tmp_path)
    before = load_model(tmp_path).eval()
    grown = load_model(tmp_path, case_type_ids=True, type_vocab_size=5).eval()
    table = grown.bert.embeddings.token_type_embeddings.weight
    assert table.shape[0] == 5 and type(grown.config.case_type_ids) is int  # true: scheme 1
    old = before.bert.embeddings.token_type_embeddings.weight
    assert torch.equal(table[:2], old) and all(torch.equal(table[i], old[0]) for i in (2, 3, 4))
    ids = torch.tensor([[2, 7, 9, 3]])
    with torch.no_grad():
        plain = before(ids, torch.ones_like(ids)).logits
        cased = grown(ids, torch.ones_like(ids), torch.tensor([[0, 2, 3, 0]])).logits
    assert torch.allclose(plain, cased, atol=1e-6)
    with pytest.raises(ValueError, match="case_type_ids 1 needs type_vocab_size >= 5"):
        load_model(tmp_path, case_type_ids=True)


def test_architecture_read_from_config(tmp_path, tiny_config):
    save_model(BertForQuestionAnswering(tiny_config), tmp_path)
    assert isinstance(load_model(tmp_path), BertForQuestionAnswering)


def test_bad_checkpoints_name_the_problem(tmp_path, tiny_config):
    save_model(BertForSequenceClassification(tiny_config), tmp_path)
    weights = tmp_path / "model.safetensors"
    good = load_file(weights)

    save_file({**good, "bert.encoder.layer.7.output.dense.weight": torch.zeros(1)}, weights)
    with pytest.raises(CheckpointError, match=r"unknown key .*bert\.encoder\.layer\.7\.output"):
        load_model(tmp_path)

    save_file({**good, "classifier.weight": torch.zeros(5, 32)}, weights)
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch for classifier\.weight: "
        r"checkpoint \(5, 32\), model \(3, 32\)",
    ):
        load_model(tmp_path)

    save_file({k: v for k, v in good.items() if "layer.1.intermediate" not in k}, weights)
    with pytest.raises(CheckpointError, match=r"missing key .*layer\.1\.intermediate"):
        load_model(tmp_path)

    weights.unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor pytorch_model.bin"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="unknown head 'BertForMultipleChoice'"):
        load_model(tmp_path, "BertForMultipleChoice")
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(tmp_path)
