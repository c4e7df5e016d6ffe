"""ModernBERT (model/modernbert.py) against transformers' own, both ways, every head: random
weights of a tiny config with local and global layers, a window smaller than the inputs, and
padded rows, so every part (RoPE at two bases, the sliding window, GeGLU, pre-LN, the heads'
pooling) must agree to 1e-5."""

from __future__ import annotations

import pytest
import torch

from bertserve.model.modernbert import (
    HEADS,
    ModernBertConfig,
    load_modernbert,
    save_modernbert,
)

transformers = pytest.importorskip("transformers")
TINY = {
    "vocab_size": 120,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,  # layers 0 and 3 global, 1 and 2 local
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "local_attention": 6,  # a position sees 3 either way: less than the inputs' 14
    "global_rope_theta": 1000.0,
    "local_rope_theta": 50.0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "cls_token_id": 1,
    "sep_token_id": 2,
    "id2label": {0: "A", 1: "B", 2: "C"},
    "label2id": {"A": 0, "B": 1, "C": 2},
}


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (3, 14), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded row
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    return ids, mask


def theirs(architecture: str, pooling: str = "cls"):
    torch.manual_seed(1)
    labels = {"id2label": {0: "start", 1: "end"}, "label2id": {"start": 0, "end": 1}}
    values = TINY | labels if architecture.endswith("QuestionAnswering") else TINY
    config = transformers.ModernBertConfig(
        **values, classifier_pooling=pooling, attn_implementation="eager"
    )
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # biases and norms away from their zeros and ones
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


def their_outputs(model, ids, mask) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    if hasattr(out, "start_logits"):
        return [out.start_logits, out.end_logits]
    return [out.logits if hasattr(out, "logits") else out.last_hidden_state]


def our_outputs(model, ids, mask) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(ids, mask)
    return list(out) if isinstance(out, tuple) else [out]


CASES = [
    ("ModernBertModel", "cls"),
    ("ModernBertForMaskedLM", "cls"),
    ("ModernBertForSequenceClassification", "cls"),
    ("ModernBertForSequenceClassification", "mean"),
    ("ModernBertForTokenClassification", "cls"),
    ("ModernBertForQuestionAnswering", "cls"),
]


@pytest.mark.parametrize(("architecture", "pooling"), CASES)
def test_their_checkpoint_loads_and_computes_the_same(architecture, pooling, tmp_path):
    model = theirs(architecture, pooling)
    model.save_pretrained(tmp_path)
    ours = load_modernbert(tmp_path)
    assert ours.architecture == architecture
    ids, mask = inputs()
    for a, b in zip(our_outputs(ours, ids, mask), their_outputs(model, ids, mask), strict=True):
        keep = mask.bool() if a.dim() > 2 or a.shape == mask.shape else slice(None)
        torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("architecture", "pooling"), CASES)
def test_our_checkpoint_loads_in_transformers(architecture, pooling, tmp_path):
    source = theirs(architecture, pooling)
    source.save_pretrained(tmp_path / "theirs")
    ours = load_modernbert(tmp_path / "theirs")
    save_modernbert(ours, tmp_path / "ours")
    again = getattr(transformers, architecture).from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    )
    ids, mask = inputs()
    for a, b in zip(their_outputs(again, ids, mask), their_outputs(source, ids, mask), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_window_matters():
    """A local layer sees less than a global one: the same weights with a window wider than
    the input compute something else (so the parity above tests the window)."""
    torch.manual_seed(0)
    narrow = HEADS["ModernBertModel"](ModernBertConfig(**_ours(TINY))).eval()
    wide = HEADS["ModernBertModel"](ModernBertConfig(**_ours(TINY | {"local_attention": 64})))
    wide.load_state_dict(narrow.state_dict())
    ids, mask = inputs()
    with torch.no_grad():
        assert not torch.allclose(narrow.model(ids, mask), wide.eval().model(ids, mask))


def test_a_config_we_cannot_compute_is_refused():
    with pytest.raises(ValueError, match="classifier_pooling"):
        ModernBertConfig(classifier_pooling="max")
    with pytest.raises(ValueError, match="not modernbert"):
        ModernBertConfig.from_dict({"model_type": "bert"})


def _ours(values: dict) -> dict:
    return {k: v for k, v in values.items() if not k.endswith("_token_id") or k == "pad_token_id"}


def test_default_labels_are_named_as_transformers_names_them(tmp_path):
    """transformers leaves id2label out of config.json at its default: the head's rows say how
    many labels, named LABEL_i (the exporter needs names for /classify)."""
    values = {k: v for k, v in TINY.items() if k not in ("id2label", "label2id")}
    config = transformers.ModernBertConfig(**values, attn_implementation="eager")
    transformers.ModernBertForSequenceClassification(config).save_pretrained(tmp_path)
    assert "id2label" not in (tmp_path / "config.json").read_text()
    assert load_modernbert(tmp_path).config.id2label == {0: "LABEL_0", 1: "LABEL_1"}
