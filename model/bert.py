"""The BERT encoder, written out: embeddings, self-attention, post-LN blocks, pooler.

Module and parameter names follow Hugging Face's `modeling_bert.py` exactly
(`embeddings.word_embeddings`, `encoder.layer.{i}.attention.self.query`, ...), so a state dict
moves between the two without renaming. The attention is written as explicit matmuls with an
additive padding mask (not `scaled_dot_product_attention`) because that is the pattern ONNX
Runtime's transformer optimiser fuses into one `Attention` node after export.

Shapes: B = batch, S = sequence length, H = hidden size, A = heads, D = H / A.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from bertserve.model.config import BertConfig


def activation(name: str) -> nn.Module:
    """`gelu` is the exact erf GELU of the original BERT; `gelu_new` its tanh approximation."""
    return nn.GELU() if name == "gelu" else nn.GELU(approximate="tanh")


def extended_attention_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) 1/0 mask -> (B, 1, 1, S) additive mask: 0 for keys to attend to, a large
    negative number for padding keys. Queries are never masked and no position is hidden from
    another (BERT is bidirectional); padded query rows are computed and ignored downstream."""
    mask = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - mask) * torch.finfo(dtype).min


class BertEmbeddings(nn.Module):
    """Word + position (+ segment) embeddings, LayerNorm, dropout. The families vary it
    (model/families.py): no segment table (DistilBERT), positions counted from padding_idx + 1
    (RoBERTa), a width of its own (ELECTRA's embedding_size)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        width = config.embedding_width
        self.position_offset = config.position_offset
        self.word_embeddings = nn.Embedding(
            config.vocab_size, width, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, width) if config.type_vocab_size else None
        )
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device)[None, :]  # (1, S)
        if self.position_offset:
            position_ids = position_ids + self.position_offset
        x = self.word_embeddings(input_ids)  # (B, S, E)
        if self.token_type_embeddings is not None:
            # No segment ids (a family with one segment, or none given): segment 0's row.
            x = x + (
                self.token_type_embeddings.weight[0]
                if token_type_ids is None
                else self.token_type_embeddings(token_type_ids)
            )
        # This order (word, segment, position) is the one ONNX Runtime's embedding fusion reads.
        x = x + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        # Separate Q/K/V projections (not one fused matrix): Hugging Face's names, and the
        # graph shape ONNX Runtime recognises as attention.
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def _heads(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_size).transpose(1, 2)  # (B, A, S, D)

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        q = self._heads(self.query(hidden))
        k = self._heads(self.key(hidden))
        v = self._heads(self.value(hidden))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size)  # (B, A, S, S)
        probs = self.dropout(torch.softmax(scores + additive_mask, dim=-1))
        context = probs @ v  # (B, A, S, D)
        b, _, s, _ = context.shape
        return context.transpose(1, 2).reshape(b, s, self.num_heads * self.head_size)  # (B, S, H)


class BertSelfOutput(nn.Module):
    """Projection, dropout, then the post-LN residual: LayerNorm(x + sublayer(x))."""

    def __init__(self, config: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, sublayer_out: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(sublayer_out)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        return self.output(self.self(hidden, additive_mask), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = activation(config.hidden_act)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.intermediate_act_fn(self.dense(hidden))  # (B, S, I)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        # Hugging Face calls the feed-forward's second projection + residual + LN "output".
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        attended = self.attention(hidden, additive_mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        for block in self.layer:
            hidden = block(hidden, additive_mask)
        return hidden


class BertPooler(nn.Module):
    """act(W h_first + b): the sentence vector that NSP and sequence classification read. tanh for
    BERT and RoBERTa, ReLU for DistilBERT, GELU for ELECTRA (their sentence heads' dense layer)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        name = config.family.sentence_activation
        self.activation = {"tanh": nn.Tanh(), "relu": nn.ReLU(), "gelu": nn.GELU()}[name]

    def forward(self, hidden: Tensor) -> Tensor:
        return self.activation(self.dense(hidden[:, 0]))  # (B, H)


class BertModel(nn.Module):
    """Embeddings (-> ELECTRA's projection) -> L post-LN blocks -> (optional) pooler."""

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        if config.embedding_width != config.hidden_size:
            self.embeddings_project = nn.Linear(config.embedding_width, config.hidden_size)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def forward(
        self,
        input_ids: Tensor,  # (B, S) int64
        attention_mask: Tensor | None = None,  # (B, S) 1 = token, 0 = padding
        token_type_ids: Tensor | None = None,  # (B, S) segment ids; None: all segment 0
    ) -> tuple[Tensor, Tensor | None]:
        """Returns (sequence_output (B, S, H), pooled_output (B, H) or None)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.embeddings(input_ids, token_type_ids)
        if hasattr(self, "embeddings_project"):
            hidden = self.embeddings_project(hidden)
        additive_mask = extended_attention_mask(attention_mask, hidden.dtype)
        sequence_output = self.encoder(hidden, additive_mask)
        pooled = self.pooler(sequence_output) if self.pooler is not None else None
        return sequence_output, pooled


def init_weights(module: nn.Module, std: float) -> None:
    """BERT's initialisation: N(0, std) weights, zero biases, LayerNorm 1/0, zero padding row."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


__all__ = ["BertModel", "extended_attention_mask", "init_weights"]
