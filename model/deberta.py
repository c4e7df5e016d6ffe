"""DeBERTa-v2 and v3 (He et al., 2021), written out: the encoder and its task heads.

What differs from BERT (model/bert.py):

- disentangled attention: besides content-to-content scores, each query's content meets the
  key's relative position (c2p) and each key's content the query's relative position (p2c),
  read from one table of relative-position embeddings that all layers share
  (`encoder.rel_embeddings`, layer-normed in v3); relative distances beyond
  `position_buckets // 2` fall in log-spaced buckets; v3 projects the positions with the
  layer's own query and key projections (`share_att_key`), v2 with its own (`pos_key_proj`,
  `pos_query_proj`); scores are scaled by sqrt(D x (1 + the position terms));
- no absolute positions in the input by default (`position_biased_input`: v3 false), no
  segments when `type_vocab_size` is 0 (v3);
- an optional convolution beside the first layer (`conv_kernel_size`, v2 xlarge);
- the sentence head is `pooler` (dense, GELU on [CLS]) then `classifier`; the MLM head is
  BERT's (`cls.predictions`: transformers' `legacy` layout, its default). Its other layout
  (`legacy: false`, `lm_predictions.lm_head`, as Microsoft's checkpoints name their MLM head)
  is refused: transformers 4.57 ties that head's dense layer to the word table and cannot run
  it either, so there is no reference to be equal to. The enhanced mask decoder of the
  paper's pre-training is not part of transformers' inference model, nor of this one.

Module and parameter names follow Hugging Face's `modeling_deberta_v2.py`, so a checkpoint's
state dict loads without renaming. Padding is masked on keys and queries both, as there.

Shapes: B = batch, S = sequence length, H = hidden size, A = heads, D = H / A.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from bertserve.model.bert import activation
from bertserve.model.families import Family
from bertserve.model.own import OwnConfig, check_fits, read_checkpoint, save_checkpoint

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "tanh")


@dataclass(frozen=True)
class DebertaV2Config(OwnConfig):
    """A DeBERTa-v2/v3 checkpoint's shape, with Hugging Face's names and defaults."""

    MODEL_TYPE: ClassVar[str] = "deberta-v2"

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-7
    relative_attention: bool = False
    max_relative_positions: int = -1
    position_buckets: int = -1
    pos_att_type: tuple[str, ...] = ()
    share_att_key: bool = False
    norm_rel_ebd: str = "none"
    position_biased_input: bool = True
    embedding_size: int | None = None
    conv_kernel_size: int = 0
    conv_groups: int = 1
    conv_act: str = "tanh"
    pooler_hidden_size: int | None = None
    pooler_hidden_act: str = "gelu"
    pooler_dropout: float = 0.0
    legacy: bool = True
    pad_token_id: int = 0
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    architectures: tuple[str, ...] | None = None
    model_type: str = "deberta-v2"

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"invalid DebertaV2Config: {message}")

        need(self.hidden_size % self.num_attention_heads == 0, "heads do not divide hidden_size")
        need(self.hidden_act in ACTIVATIONS, f"hidden_act {self.hidden_act!r}")
        need(self.pooler_hidden_act in ACTIVATIONS, f"pooler_hidden_act {self.pooler_hidden_act!r}")
        need(set(self.pos_att_type) <= {"c2p", "p2c"}, f"pos_att_type {self.pos_att_type}")
        need(
            self.pooler_hidden_size in (None, self.hidden_size),
            "pooler_hidden_size differs from hidden_size",
        )
        need(self.legacy, "legacy false (the lm_predictions MLM head) is not supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def relative_span(self) -> int:
        """Half the rows of the relative-position table: the buckets, else the distances."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative

    @property
    def max_relative(self) -> int:
        return (
            self.max_relative_positions
            if self.max_relative_positions >= 1
            else self.max_position_embeddings
        )

    @property
    def family(self) -> Family:
        """What the exporter reads of a family: segments only where the config has them."""
        return DEBERTA_SEGMENTS if self.type_vocab_size else DEBERTA

    @property
    def max_sequence(self) -> int:
        return self.max_position_embeddings

    @property
    def case_type_ids(self) -> int:
        return 0

    @classmethod
    def adapt(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Unset (null) keys take our defaults; pos_att_type may be "p2c|c2p"."""
        values = {k: v for k, v in values.items() if v is not None}
        pos = values.get("pos_att_type", ())
        values["pos_att_type"] = tuple(pos.split("|") if isinstance(pos, str) else pos)
        return values

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict() | {"pos_att_type": list(self.pos_att_type)}
        # unset sizes are left out: transformers takes the hidden size for them
        return {k: v for k, v in data.items() if v is not None}


DEBERTA = Family(
    model_type="deberta-v2",
    classes="DebertaV2",
    segments=False,
    offset_positions=False,
    sentence_activation="gelu",
    prefix="deberta.",
)
DEBERTA_SEGMENTS = dataclasses.replace(DEBERTA, segments=True)


def log_buckets(relative: Tensor, buckets: int, max_position: int) -> Tensor:
    """Relative distances (long) into buckets: exact within buckets // 2 either way, then
    log-spaced up to max_position, the sign kept (computed as transformers computes it, in
    float32, so that each distance falls in the same bucket)."""
    sign = torch.sign(relative)
    mid = buckets // 2
    near = (relative < mid) & (relative > -mid)
    absolute = torch.where(near, torch.tensor(mid - 1).type_as(relative), relative.abs())
    ratio = torch.log(torch.tensor((max_position - 1) / mid))
    far = torch.ceil(torch.log(absolute / mid) / ratio * (mid - 1)) + mid
    return torch.where(absolute <= mid, relative.type_as(far), far * sign).long()


def relative_positions(length: int, config: DebertaV2Config, device: torch.device) -> Tensor:
    """(S, S): query i's position relative to key j, i - j, bucketed where the config says."""
    places = torch.arange(length, dtype=torch.long, device=device)
    relative = places[:, None] - places[None, :]
    if config.position_buckets > 0 and config.max_relative > 0:
        relative = log_buckets(relative, config.position_buckets, config.max_relative)
    return relative


class DebertaV2Embeddings(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        width = config.embedding_size or config.hidden_size
        self.word_embeddings = nn.Embedding(
            config.vocab_size, width, padding_idx=config.pad_token_id
        )
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, width)
            if config.position_biased_input
            else None
        )
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, width) if config.type_vocab_size else None
        )
        self.embed_proj = (
            nn.Linear(width, config.hidden_size, bias=False)
            if width != config.hidden_size
            else None
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None, mask: Tensor) -> Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            places = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
            x = x + self.position_embeddings(places)
        if self.token_type_embeddings is not None:
            segments = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.token_type_embeddings(segments)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        x = self.LayerNorm(x) * mask.unsqueeze(-1).to(x.dtype)
        return self.dropout(x)


class DisentangledSelfAttention(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        width = config.hidden_size
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query_proj = nn.Linear(width, width)
        self.key_proj = nn.Linear(width, width)
        self.value_proj = nn.Linear(width, width)
        self.relative = config.relative_attention
        self.types = config.pos_att_type if self.relative else ()
        self.share = config.share_att_key
        self.span = config.relative_span
        if self.relative and not self.share:
            if "c2p" in self.types:
                self.pos_key_proj = nn.Linear(width, width)
            if "p2c" in self.types:
                self.pos_query_proj = nn.Linear(width, width)
        self.pos_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def split(self, x: Tensor) -> Tensor:
        """(..., N, H) -> (..., A, N, D)."""
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(-2, -3)

    def forward(
        self, hidden: Tensor, mask: Tensor, relative: Tensor, table: Tensor | None
    ) -> Tensor:
        query = self.split(self.query_proj(hidden))  # (B, A, S, D)
        key = self.split(self.key_proj(hidden))
        value = self.split(self.value_proj(hidden))
        scale = math.sqrt(self.head_dim * (1 + len(self.types)))
        scores = torch.matmul(query, key.transpose(-1, -2) / scale)
        if table is not None and self.types:
            rows = self.pos_dropout(table[: 2 * self.span])  # (2 span, H)
            # Indices broadcast with expand_as, not expand(shape): traced for the export, a
            # shape read in Python would be fixed at the example's batch and length.
            if "c2p" in self.types:
                keys = self.split(self.key_proj(rows) if self.share else self.pos_key_proj(rows))
                c2p = torch.matmul(query, keys.transpose(-1, -2))  # (B, A, S, 2 span)
                index = torch.clamp(relative + self.span, 0, 2 * self.span - 1)
                scores = scores + torch.gather(c2p, -1, index.expand_as(scores)) / scale
            if "p2c" in self.types:
                queries = self.split(
                    self.query_proj(rows) if self.share else self.pos_query_proj(rows)
                )
                p2c = torch.matmul(key, queries.transpose(-1, -2))  # (B, A, S keys, 2 span)
                index = torch.clamp(-relative + self.span, 0, 2 * self.span - 1)
                gathered = torch.gather(p2c, -1, index.expand_as(scores))
                scores = scores + gathered.transpose(-1, -2) / scale
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        return torch.matmul(weights, value).transpose(1, 2).flatten(-2)  # (B, S, H)


class DebertaV2SelfOutput(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class DebertaV2Attention(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.self = DisentangledSelfAttention(config)
        self.output = DebertaV2SelfOutput(config)


class DebertaV2Intermediate(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.act(self.dense(hidden))


class DebertaV2Output(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class DebertaV2Layer(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.attention = DebertaV2Attention(config)
        self.intermediate = DebertaV2Intermediate(config)
        self.output = DebertaV2Output(config)

    def forward(
        self, hidden: Tensor, mask: Tensor, relative: Tensor, table: Tensor | None
    ) -> Tensor:
        attended = self.attention.output(self.attention.self(hidden, mask, relative, table), hidden)
        return self.output(self.intermediate(attended), attended)


class ConvLayer(nn.Module):
    """DeBERTa-v2 xlarge's convolution beside the first layer."""

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        size = config.conv_kernel_size
        self.conv = nn.Conv1d(
            config.hidden_size,
            config.hidden_size,
            size,
            padding=(size - 1) // 2,
            groups=config.conv_groups,
        )
        self.act = activation(config.conv_act) if config.conv_act != "tanh" else nn.Tanh()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: Tensor, residual: Tensor, mask: Tensor) -> Tensor:
        keep = mask.unsqueeze(-1).to(hidden.dtype)  # (B, S, 1)
        out = self.conv(hidden.transpose(1, 2)).transpose(1, 2) * keep
        return self.LayerNorm(residual + self.act(self.dropout(out))) * keep


class DebertaV2Encoder(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList(DebertaV2Layer(config) for _ in range(config.num_hidden_layers))
        if config.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * config.relative_span, config.hidden_size)
        self.norm_table = "layer_norm" in config.norm_rel_ebd.lower().split("|")
        if self.norm_table:
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.conv = ConvLayer(config) if config.conv_kernel_size > 0 else None

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        keys = attention_mask.bool()
        mask = keys[:, None, :, None] & keys[:, None, None, :]  # (B, 1, S, S)
        relative = relative_positions(hidden.shape[1], self.config, hidden.device)
        table = None
        if self.config.relative_attention:
            table = self.rel_embeddings.weight
            if self.norm_table:
                table = self.LayerNorm(table)
        embedded = hidden
        for i, layer in enumerate(self.layer):
            hidden = layer(hidden, mask, relative, table)
            if i == 0 and self.conv is not None:
                hidden = self.conv(embedded, hidden, attention_mask)
        return hidden


class DebertaV2Model(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.embeddings = DebertaV2Embeddings(config)
        self.encoder = DebertaV2Encoder(config)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        return self.encoder(
            self.embeddings(input_ids, token_type_ids, attention_mask), attention_mask
        )


class DebertaV2PreTrainedModel(nn.Module):
    architecture = "DebertaV2Model"

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.config = config
        self.deberta = DebertaV2Model(config)

    def encode(
        self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None
    ) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.deberta(input_ids, attention_mask, token_type_ids)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Any:
        return self.head(self.encode(input_ids, attention_mask, token_type_ids))

    def head(self, hidden: Tensor) -> Any:
        """The head on the final states (B, S, H); the bare encoder answers them."""
        return hidden


class PredictionTransform(nn.Module):
    """dense, act, LayerNorm: before the MLM decoder."""

    def __init__(self, config: DebertaV2Config, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, width)
        self.transform_act_fn = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden)))


class LegacyPredictions(nn.Module):
    """`cls.predictions`: BERT's layout (transformers' `legacy`)."""

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        width = config.embedding_size or config.hidden_size
        self.transform = PredictionTransform(config, width)
        self.decoder = nn.Linear(width, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))


class LegacyMLMHead(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.predictions = LegacyPredictions(config)


class DebertaV2ForMaskedLM(DebertaV2PreTrainedModel):
    architecture = "DebertaV2ForMaskedLM"

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        self.cls = LegacyMLMHead(config)
        self.cls.predictions.decoder.weight = self.deberta.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids)
        if positions is not None:
            index = positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            hidden = torch.gather(hidden, 1, index)
        head = self.cls.predictions
        return head.decoder(head.transform(hidden)) + head.bias


class ContextPooler(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.pooler_dropout)
        self.act = activation(config.pooler_hidden_act)
        if config.pooler_hidden_act == "tanh":
            self.act = nn.Tanh()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.act(self.dense(self.dropout(hidden[:, 0])))


class DebertaV2ForSequenceClassification(DebertaV2PreTrainedModel):
    architecture = "DebertaV2ForSequenceClassification"

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        self.pooler = ContextPooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def head(self, hidden: Tensor) -> Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))


class DebertaV2ForTokenClassification(DebertaV2PreTrainedModel):
    architecture = "DebertaV2ForTokenClassification"

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def head(self, hidden: Tensor) -> Tensor:
        return self.classifier(self.dropout(hidden))


class DebertaV2ForQuestionAnswering(DebertaV2PreTrainedModel):
    architecture = "DebertaV2ForQuestionAnswering"

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def head(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        start, end = self.qa_outputs(hidden).unbind(-1)
        return start, end


HEADS: dict[str, type[DebertaV2PreTrainedModel]] = {
    cls.architecture: cls
    for cls in (
        DebertaV2PreTrainedModel,
        DebertaV2ForMaskedLM,
        DebertaV2ForSequenceClassification,
        DebertaV2ForTokenClassification,
        DebertaV2ForQuestionAnswering,
    )
}
# Our head names (model/heads.py, what export/graph.py asks for) -> DeBERTa's.
OURS = {
    "BertModel": "DebertaV2Model",
    "BertForMaskedLM": "DebertaV2ForMaskedLM",
    "BertForSequenceClassification": "DebertaV2ForSequenceClassification",
    "BertForTokenClassification": "DebertaV2ForTokenClassification",
    "BertForQuestionAnswering": "DebertaV2ForQuestionAnswering",
}
_TIED = "cls.predictions.decoder.weight"
_WORDS = "deberta.embeddings.word_embeddings.weight"


def load_deberta(directory: str | Path, head: str | None = None) -> DebertaV2PreTrainedModel:
    """A Hugging Face DeBERTa-v2/v3 checkpoint directory into `head` (default: its config's
    architecture). Every tensor must find its place, and every place its tensor (the tied
    decoder aside); the bare encoder drops a head's."""
    directory = Path(directory)
    config, name, state = read_checkpoint(directory, DebertaV2Config, HEADS, OURS, head)
    bare = ("embeddings.", "encoder.")
    state = {f"deberta.{k}" if k.startswith(bare) else k: v for k, v in state.items()}
    model = HEADS[name](config)
    if _TIED in model.state_dict():
        state[_TIED] = state[_WORDS]
    if name == "DebertaV2Model":
        state = {k: v for k, v in state.items() if k.startswith("deberta.")}
    model.load_state_dict(check_fits(directory, name, model, state))
    return model.eval()


def save_deberta(model: DebertaV2PreTrainedModel, directory: str | Path) -> Path:
    """config.json and model.safetensors as Hugging Face writes them."""
    return save_checkpoint(model, directory, "deberta.", _TIED)
