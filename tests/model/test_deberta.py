"""DeBERTa-v2/v3 (model/deberta.py) against transformers' own, both ways, every head: random
weights of tiny configs in the v3 layout (shared position projections, log buckets closer than
the inputs' length, a layer-normed position table, no absolute positions, no segments) and the
v2 layout (its own position projections, segments, absolute positions, the convolution), with
padded rows, to 1e-5."""

from __future__ import annotations

import pytest
import torch

from bertserve.model.deberta import DebertaV2Config, load_deberta, save_deberta

transformers = pytest.importorskip("transformers")
BASE = {
    "vocab_size": 120,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "relative_attention": True,
    "pad_token_id": 0,
    "hidden_act": "gelu",
    "id2label": {0: "A", 1: "B", 2: "C"},
    "label2id": {"A": 0, "B": 1, "C": 2},
}
V3 = BASE | {
    "position_buckets": 8,  # distances past 4 in log buckets: the inputs are 14 long
    "max_relative_positions": -1,
    "pos_att_type": ["p2c", "c2p"],
    "share_att_key": True,
    "norm_rel_ebd": "layer_norm",
    "position_biased_input": False,
    "type_vocab_size": 0,
}
V2 = BASE | {
    "max_relative_positions": 6,
    "pos_att_type": ["c2p", "p2c"],
    "share_att_key": False,
    "position_biased_input": True,
    "type_vocab_size": 2,
    "conv_kernel_size": 3,
    "conv_act": "gelu",
}
HEADS = [
    "DebertaV2Model",
    "DebertaV2ForMaskedLM",
    "DebertaV2ForSequenceClassification",
    "DebertaV2ForTokenClassification",
    "DebertaV2ForQuestionAnswering",
]
CASES = [(h, "v3") for h in HEADS] + [(h, "v2") for h in HEADS]


def inputs(segments: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (3, 14), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    types = (torch.arange(14) >= 7).long().expand(3, -1) * mask if segments else None
    return ids, mask, types


def theirs(architecture: str, layout: str):
    torch.manual_seed(1)
    values = V3 if layout == "v3" else V2
    if architecture.endswith("QuestionAnswering"):  # start and end
        values = values | {"id2label": {0: "start", 1: "end"}, "label2id": {"start": 0, "end": 1}}
    config = transformers.DebertaV2Config(**values)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # norms and biases away from their ones and zeros
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


def their_outputs(model, ids, mask, types) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if hasattr(out, "start_logits"):
        return [out.start_logits, out.end_logits]
    return [out.logits if hasattr(out, "logits") else out.last_hidden_state]


def our_outputs(model, ids, mask, types) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(ids, mask, types)
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize(("architecture", "layout"), CASES)
def test_their_checkpoint_loads_and_computes_the_same(architecture, layout, tmp_path):
    model = theirs(architecture, layout)
    model.save_pretrained(tmp_path)
    ours = load_deberta(tmp_path)
    assert ours.architecture == architecture
    feeds = inputs(layout == "v2")
    for a, b in zip(our_outputs(ours, *feeds), their_outputs(model, *feeds), strict=True):
        mask = feeds[1].bool()
        keep = mask if a.shape[:2] == mask.shape else slice(None)
        torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("architecture", "layout"), CASES[:5])
def test_our_checkpoint_loads_in_transformers(architecture, layout, tmp_path):
    source = theirs(architecture, layout)
    source.save_pretrained(tmp_path / "theirs")
    save_deberta(load_deberta(tmp_path / "theirs"), tmp_path / "ours")
    again = getattr(transformers, architecture).from_pretrained(tmp_path / "ours")
    feeds = inputs(False)
    for a, b in zip(their_outputs(again, *feeds), their_outputs(source, *feeds), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_config_we_cannot_compute_is_refused():
    with pytest.raises(ValueError, match="pos_att_type"):
        DebertaV2Config(pos_att_type=("p2p",))
    with pytest.raises(ValueError, match="legacy false"):
        DebertaV2Config(legacy=False)
    with pytest.raises(ValueError, match="not deberta-v2"):
        DebertaV2Config.from_dict({"model_type": "deberta"})
