"""ModernBERT (Warner et al., 2024), written out: the encoder and its task heads.

What differs from BERT (model/bert.py):

- blocks: pre-LN, not post-LN (the first block has no attention norm), and a final norm;
- positions: rotary (RoPE), not a learned table, at base `global_rope_theta` in global layers
  and `local_rope_theta` in local ones;
- attention: every `global_attn_every_n_layers`-th layer (0, 3, 6, ...) is global; in the others
  a position sees only those within `local_attention // 2` either way;
- feed-forward: GeGLU (`Wi` to 2 x intermediate, act(first half) x second half, `Wo`);
- no biases by default (`attention_bias`, `mlp_bias`, `norm_bias`, `classifier_bias`), no
  segments;
- sentence head: [CLS]'s state or the sequence's mean (`classifier_pooling`), then dense, act,
  norm (`head`), as before every classifier and the MLM decoder.

Module and parameter names follow Hugging Face's `modeling_modernbert.py`
(`model.layers.{i}.attn.Wqkv`, `head.dense`, `decoder`), so a checkpoint's state dict loads
without renaming. The attention is explicit matmuls with an additive mask (padding, and the
sliding window in local layers), as model/bert.py writes it for the export. Dropout is kept for
fine-tuning; every probability defaults to 0, as the published checkpoints set it.

Shapes: B = batch, S = sequence length, H = hidden size, A = heads, D = H / A.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from bertserve.model.bert import activation
from bertserve.model.families import Family
from bertserve.model.own import OwnConfig, check_fits, read_checkpoint, save_checkpoint

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
MODERNBERT = Family(
    model_type="modernbert",
    classes="ModernBert",
    segments=False,
    offset_positions=False,
    sentence_activation="gelu",
    prefix="model.",
    pooler=False,
)


@dataclass(frozen=True)
class ModernBertConfig(OwnConfig):
    """The shape of a ModernBERT checkpoint, with Hugging Face's field names and defaults."""

    MODEL_TYPE: ClassVar[str] = "modernbert"

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    global_rope_theta: float = 160000.0
    local_rope_theta: float | None = 10000.0
    global_attn_every_n_layers: int = 3
    local_attention: int = 128
    attention_bias: bool = False
    mlp_bias: bool = False
    decoder_bias: bool = True
    classifier_bias: bool = False
    hidden_activation: str = "gelu"
    classifier_activation: str = "gelu"
    classifier_pooling: str = "cls"  # or "mean"
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0
    classifier_dropout: float = 0.0
    pad_token_id: int = 50283
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    architectures: tuple[str, ...] | None = None
    model_type: str = "modernbert"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"invalid ModernBertConfig: hidden_size {self.hidden_size} is not a multiple "
                f"of num_attention_heads {self.num_attention_heads}"
            )
        for name in ("hidden_activation", "classifier_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(
                    f"invalid ModernBertConfig: {name} {getattr(self, name)!r}; supported: "
                    f"{ACTIVATIONS}"
                )
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(
                f"invalid ModernBertConfig: classifier_pooling {self.classifier_pooling!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def family(self) -> Family:
        """What the exporter reads of a family (no segments): ModernBERT's names are its own,
        so no renaming rules."""
        return MODERNBERT

    @property
    def max_sequence(self) -> int:
        return self.max_position_embeddings

    @property
    def case_type_ids(self) -> int:
        return 0  # letter case as segments is BERT's (model/config.py); no segments here

    def is_global(self, layer: int) -> bool:
        return layer % self.global_attn_every_n_layers == 0

    def rope_base(self, layer: int) -> float:
        if self.is_global(layer) or self.local_rope_theta is None:
            return self.global_rope_theta
        return self.local_rope_theta


def rotary(positions: Tensor, dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin, (S, D), of RoPE at `positions`: frequencies base^(-2i/D), each used for
    both halves of a head's dimensions (the rotate-half layout)."""
    inverse = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inverse[None, :]
    both = torch.cat((angles, angles), dim=-1)
    return both.cos(), both.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, A, S, D) turned by RoPE: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.is_global = config.is_global(layer)
        self.base = config.rope_base(layer)
        hidden = config.hidden_size
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.Wo = nn.Linear(hidden, hidden, bias=config.attention_bias)
        self.drop = nn.Dropout(config.attention_dropout)

    def forward(self, hidden: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        batch, length, width = hidden.shape
        qkv = self.Wqkv(hidden).view(batch, length, 3, self.heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, A, S, D)
        cos, sin = rope
        # the scale on the queries (S x D a head), not on the scores (S x S)
        query = rotate(query, cos, sin) * self.head_dim**-0.5
        scores = torch.matmul(query, rotate(key, cos, sin).transpose(-1, -2)) + mask
        weights = self.drop(torch.softmax(scores, dim=-1))
        context = torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, width)
        return self.Wo(context)


class ModernBertMLP(nn.Module):
    """GeGLU: Wi to two halves, act(first) x second, Wo."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_activation)
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: Tensor) -> Tensor:
        first, gate = self.Wi(hidden).chunk(2, dim=-1)
        return self.Wo(self.drop(self.act(first) * gate))


class ModernBertLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int) -> None:
        super().__init__()
        width, eps, bias = config.hidden_size, config.norm_eps, config.norm_bias
        self.attn_norm: nn.Module = (
            nn.Identity() if layer == 0 else nn.LayerNorm(width, eps=eps, bias=bias)
        )
        self.attn = ModernBertAttention(config, layer)
        self.mlp_norm = nn.LayerNorm(width, eps=eps, bias=bias)
        self.mlp = ModernBertMLP(config)

    def forward(self, hidden: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), mask, rope)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertModel(nn.Module):
    """The encoder: (B, S) ids and 1/0 mask -> (B, S, H) final-normed states."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.final_norm = nn.LayerNorm(
            config.hidden_size, eps=config.norm_eps, bias=config.norm_bias
        )

    def masks(self, attention_mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Additive masks of the global layers ((B, 1, 1, S): padding keys) and the local ones
        ((B, 1, S, S): padding keys and keys beyond local_attention // 2 either way)."""
        lowest = torch.finfo(dtype).min
        keys = attention_mask[:, None, None, :].to(torch.bool)  # (B, 1, 1, S)
        length = attention_mask.shape[1]
        places = torch.arange(length, device=attention_mask.device)
        near = (places[None, :] - places[:, None]).abs() <= self.config.local_attention // 2
        zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
        full = torch.where(keys, zero, lowest)
        window = torch.where(keys & near[None, None], zero, lowest)
        return full, window

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.embeddings(input_ids)
        full, window = self.masks(attention_mask, hidden.dtype)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        ropes: dict[float, tuple[Tensor, Tensor]] = {}  # cos and sin, once a base
        for i, layer in enumerate(self.layers):
            base = self.config.rope_base(i)
            if base not in ropes:
                ropes[base] = rotary(positions, self.config.head_dim, base)
            hidden = layer(hidden, full if self.config.is_global(i) else window, ropes[base])
        return self.final_norm(hidden)


class ModernBertPredictionHead(nn.Module):
    """dense, act, norm: before the MLM decoder and every classifier."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.dense = nn.Linear(width, width, bias=config.classifier_bias)
        self.act = activation(config.classifier_activation)
        self.norm = nn.LayerNorm(width, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(hidden)))


class ModernBertPreTrainedModel(nn.Module):
    architecture = "ModernBertModel"

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Any:
        return self.model(input_ids, attention_mask)  # (B, S, H); the heads' own below


class ModernBertForMaskedLM(ModernBertPreTrainedModel):
    """Vocabulary logits at every position, or (`positions`, (B, P)) at those only; the
    decoder's weight is the token embedding table."""

    architecture = "ModernBertForMaskedLM"

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__(config)
        self.head = ModernBertPredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        hidden = self.model(input_ids, attention_mask)
        if positions is not None:
            index = positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            hidden = torch.gather(hidden, 1, index)
        return self.decoder(self.head(hidden))


class _Classifier(ModernBertPreTrainedModel):
    def __init__(self, config: ModernBertConfig, outputs: int) -> None:
        super().__init__(config)
        self.head = ModernBertPredictionHead(config)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, outputs)

    def classify(self, hidden: Tensor) -> Tensor:
        return self.classifier(self.drop(self.head(hidden)))


class ModernBertForSequenceClassification(_Classifier):
    """(B, num_labels) from [CLS]'s state or the sequence's mean (`classifier_pooling`)."""

    architecture = "ModernBertForSequenceClassification"

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__(config, config.num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask)
        if self.config.classifier_pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1)
        return self.classify(pooled)


class ModernBertForTokenClassification(_Classifier):
    architecture = "ModernBertForTokenClassification"

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__(config, config.num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.classify(self.model(input_ids, attention_mask))  # (B, S, num_labels)


class ModernBertForQuestionAnswering(_Classifier):
    architecture = "ModernBertForQuestionAnswering"

    def __init__(self, config: ModernBertConfig) -> None:
        if config.num_labels != 2:
            raise ValueError(f"a question-answering head has 2 outputs, not {config.num_labels}")
        super().__init__(config, 2)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        logits = self.classify(self.model(input_ids, attention_mask))
        start, end = logits.unbind(-1)
        return start, end  # (B, S) each


HEADS: dict[str, type[ModernBertPreTrainedModel]] = {
    cls.architecture: cls
    for cls in (
        ModernBertPreTrainedModel,
        ModernBertForMaskedLM,
        ModernBertForSequenceClassification,
        ModernBertForTokenClassification,
        ModernBertForQuestionAnswering,
    )
}


# Our head names (model/heads.py, what export/graph.py asks for) -> ModernBERT's.
OURS = {
    "BertModel": "ModernBertModel",
    "BertForMaskedLM": "ModernBertForMaskedLM",
    "BertForSequenceClassification": "ModernBertForSequenceClassification",
    "BertForTokenClassification": "ModernBertForTokenClassification",
    "BertForQuestionAnswering": "ModernBertForQuestionAnswering",
}


def load_modernbert(directory: str | Path, head: str | None = None) -> ModernBertPreTrainedModel:
    """A Hugging Face ModernBERT checkpoint directory (config.json, model.safetensors) into
    `head` (default: its config's architecture). Every tensor must find its place, and every
    place its tensor (the tied decoder aside); the bare encoder drops a head's."""
    directory = Path(directory)
    config, name, state = read_checkpoint(directory, ModernBertConfig, HEADS, OURS, head)
    model = HEADS[name](config)
    if name == "ModernBertModel":  # the encoder alone: a bare one's keys have no "model."
        bare = ("embeddings.", "layers.", "final_norm.")
        state = {
            k if k.startswith("model.") else f"model.{k}": v
            for k, v in state.items()
            if k.startswith(("model.", *bare))
        }
    if "decoder.weight" not in state and hasattr(model, "decoder"):
        state["decoder.weight"] = state["model.embeddings.tok_embeddings.weight"]
    model.load_state_dict(check_fits(directory, name, model, state))
    return model.eval()


def save_modernbert(model: ModernBertPreTrainedModel, directory: str | Path) -> Path:
    """config.json and model.safetensors as Hugging Face writes them."""
    return save_checkpoint(model, directory, "model.", "decoder.weight")
