"""DistilBERT, RoBERTa, XLM-RoBERTa and ELECTRA checkpoints move both ways between our encoder
(model/bert.py with the family's variations) and `transformers`, every head, at 1e-5."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from bertserve.model.checkpoint import CheckpointError, load_model, save_model
from bertserve.model.config import BertConfig
from bertserve.model.heads import HEADS

SHAPE = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
    "max_position_embeddings": 66,
}
LABELS = {"id2label": {0: "A", 1: "B", 2: "C"}, "label2id": {"A": 0, "B": 1, "C": 2}}


def hf_config(family: str, head: str) -> transformers.PretrainedConfig:
    labels = LABELS if head.endswith(("SequenceClassification", "TokenClassification")) else {}
    if family == "distilbert":
        return transformers.DistilBertConfig(
            vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
            max_position_embeddings=64, pad_token_id=0, **labels,
        )  # fmt: skip
    if family == "electra":
        return transformers.ElectraConfig(**SHAPE, embedding_size=16, pad_token_id=0, **labels)
    cls = transformers.RobertaConfig if family == "roberta" else transformers.XLMRobertaConfig
    return cls(**SHAPE, type_vocab_size=1, pad_token_id=1, **labels)


CLASSES = {"distilbert": "DistilBert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}
CLASSES["electra"] = "Electra"
SUFFIXES = [
    "Model",
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
]
CASES = [(f, f"{c}{s}") for f, c in CLASSES.items() for s in SUFFIXES]
CASES.append(("electra", "ElectraForPreTraining"))  # the discriminator


def batch(config: BertConfig | transformers.PretrainedConfig) -> dict[str, torch.Tensor]:
    """Three rows of lengths 7, 4 and 1, right-padded with the family's pad id; two segments
    on row 0 where the family has segments."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] + [0] * 6])
    ids = torch.randint(5, 99, (3, 7), generator=g) * mask + (1 - mask) * config.pad_token_id
    feeds = {"input_ids": ids, "attention_mask": mask}
    if config.model_type == "electra":
        feeds["token_type_ids"] = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0] * 7, [0] * 7])
    return feeds


def outputs(model: torch.nn.Module, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor a model returns, ours or theirs, in one order."""
    with torch.no_grad():
        out = model(**feeds)
    if isinstance(out, tuple):  # our bare encoder: (sequence, pooled or None)
        return [t for t in out if t is not None]
    names = ("last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits")
    names += ("mlm_logits",)
    return [getattr(out, n) for n in names if getattr(out, n, None) is not None]


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor], mask: torch.Tensor) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if a.dim() >= 2 and a.shape[:2] == mask.shape:  # per token: padding is don't-care
            a, b = a[mask.bool()], b[mask.bool()]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "name"), CASES)
def test_their_checkpoint_loads_into_ours(tmp_path, family, name):
    torch.manual_seed(0)
    theirs = getattr(transformers, name)(hf_config(family, name)).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(tmp_path).eval()
    assert ours.config.model_type == family
    feeds = batch(ours.config)
    assert_same(outputs(ours, feeds), outputs(theirs, feeds), feeds["attention_mask"])


@pytest.mark.parametrize(("family", "name"), CASES)
def test_our_checkpoint_loads_into_theirs(tmp_path, family, name):
    torch.manual_seed(1)
    config = BertConfig.from_dict(hf_config(family, name).to_dict() | {"architectures": [name]})
    ours = HEADS[config.architectures[0]](config).eval()
    save_model(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [name]
    theirs = getattr(transformers, name).from_pretrained(tmp_path).eval()
    feeds = batch(config)
    assert_same(outputs(ours, feeds), outputs(theirs, feeds), feeds["attention_mask"])
    # and back: what we wrote loads into ours unchanged
    again = load_model(tmp_path).eval()
    assert_same(outputs(again, feeds), outputs(ours, feeds), feeds["attention_mask"])


def test_their_names_are_written(tmp_path):
    """The keys are the family's own, not BERT's: transformers loads them without a warning
    about unused or newly initialised weights (which the parity above would also catch)."""
    config = BertConfig.from_dict(hf_config("roberta", "x").to_dict())
    save_model(HEADS["BertForSequenceClassification"](config.replace(**LABELS)), tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert {"classifier.dense.weight", "classifier.out_proj.weight"} <= keys
    assert not any(k.startswith(("bert.", "cls.")) for k in keys)
    distil = BertConfig.from_dict(hf_config("distilbert", "x").to_dict())
    save_model(HEADS["BertForMaskedLM"](distil), tmp_path / "d")
    keys = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert "distilbert.transformer.layer.1.attention.q_lin.weight" in keys
    assert {"vocab_transform.weight", "vocab_layer_norm.weight", "vocab_projector.bias"} <= keys
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["dim"] == 32 and "hidden_size" not in written


def test_a_bare_encoder_without_its_prefix_loads(tmp_path):
    """`RobertaModel.save_pretrained` writes `embeddings.*` without `roberta.`."""
    torch.manual_seed(0)
    theirs = transformers.RobertaModel(hf_config("roberta", "RobertaModel")).eval()
    state = {k.removeprefix("roberta."): v for k, v in theirs.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    theirs.config.to_json_file(tmp_path / "config.json")
    ours = load_model(tmp_path, "BertModel").eval()
    feeds = batch(ours.config)
    assert_same(outputs(ours, feeds), outputs(theirs, feeds), feeds["attention_mask"])


def test_what_a_family_lacks_is_refused_by_name(tmp_path):
    roberta = BertConfig.from_dict(hf_config("roberta", "x").to_dict())
    with pytest.raises(CheckpointError, match="roberta has no BertForPreTraining head"):
        save_model(HEADS["BertForPreTraining"](roberta), tmp_path)
    with pytest.raises(ValueError, match="model_type 'deberta-v2'; supported: bert, distilbert"):
        BertConfig.from_dict({"model_type": "deberta-v2"})
    with pytest.raises(ValueError, match="embedding_size is an ELECTRA setting"):
        BertConfig(embedding_size=16)
    assert roberta.position_offset == 2 and roberta.max_sequence == 64


def test_a_config_without_labels_takes_them_from_the_head(tmp_path):
    """transformers writes no id2label when it is its default (two labels, LABEL_0/LABEL_1):
    the classifier's rows give the count, and the names are transformers' defaults."""
    theirs = transformers.RobertaForSequenceClassification(hf_config("roberta", "x"))
    theirs.save_pretrained(tmp_path)
    assert "id2label" not in json.loads((tmp_path / "config.json").read_text())
    ours = load_model(tmp_path)
    assert ours.config.id2label == {0: "LABEL_0", 1: "LABEL_1"}
    assert ours.config.id2label == theirs.config.id2label
