"""`BertConfig`: the model's shape, with Hugging Face field names, to and from config.json.

The field names are exactly those of `transformers.BertConfig`, so a `config.json` moves both ways:
`transformers` reads ours and we read theirs. `model_type` names the encoder family
(model/families.py): RoBERTa's, XLM-R's and ELECTRA's configs use BERT's names (ELECTRA adds
`embedding_size`); DistilBERT's own names (`dim`, `n_layers`, ...) are translated both ways.

Keys that Hugging Face writes but that do not change this model (``transformers_version``,
``use_cache``, ...) are accepted and dropped; keys that would change the computation into something
we do not implement (relative positions, a decoder) are refused with the offending value.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertserve.model.families import DISTILBERT_KEYS, Family, family

log = logging.getLogger(__name__)

SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# Letter case as segment ids (case_type_ids): the segment ids each scheme uses, so a config is
# checked against its segment table. The ids themselves are computed by runtime/encoding.py,
# whose case_type_vocab a test holds to this table.
CASE_SEGMENTS = {1: 5, 2: 6}

# Hugging Face keys whose value must be this for the checkpoint to mean what our model computes.
_REQUIRED_VALUES: dict[str, Any] = {
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
    "chunk_size_feed_forward": 0,
}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522  # WordPiece vocabulary, [PAD] at pad_token_id
    hidden_size: int = 768  # H: width of every residual stream
    num_hidden_layers: int = 12  # L: post-LN encoder blocks
    num_attention_heads: int = 12  # A: heads; H % A == 0
    intermediate_size: int = 3072  # feed-forward width (4H in BERT)
    hidden_act: str = "gelu"  # "gelu" = exact erf GELU; "gelu_new" = tanh approximation
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512  # learned absolute positions: the longest sequence
    type_vocab_size: int = 2  # segment ids: 0 = sentence A, 1 = sentence B
    initializer_range: float = 0.02  # std of the normal init of every weight matrix
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    classifier_dropout: float | None = None  # None: use hidden_dropout_prob
    id2label: dict[int, str] | None = None  # labels of a classification / tagging head
    label2id: dict[str, int] | None = None
    architectures: tuple[str, ...] | None = None  # e.g. ("BertForPreTraining",)
    # Not a Hugging Face key (transformers keeps it as an attribute and ignores it): the segment
    # ids of a one-segment input carry each piece's letter case (runtime/tasks/ner.py
    # case_type), so a model with an uncased vocabulary sees capitals. 0 off; scheme 1 (or true)
    # needs 5 segment ids, scheme 2 (a text without capitals reads as "case unknown") 6.
    case_type_ids: int = 0
    model_type: str = "bert"  # the encoder family (model/families.py)
    embedding_size: int | None = None  # ELECTRA: embeddings this wide, projected to hidden_size

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"invalid BertConfig: {message}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, int) and value > 0,
                f"{name} must be a positive int, got {value!r}",
            )
        fam = family(self.model_type)
        need(
            isinstance(self.type_vocab_size, int)
            and (self.type_vocab_size > 0 or not fam.segments),
            f"type_vocab_size must be a positive int, got {self.type_vocab_size!r}",
        )
        need(
            self.embedding_size is None
            or (self.embedding_size > 0 and fam.model_type == "electra"),
            f"embedding_size is an ELECTRA setting (model_type {self.model_type!r})",
        )
        need(
            self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size {self.hidden_size} is not divisible by "
            f"num_attention_heads {self.num_attention_heads}",
        )
        need(
            self.hidden_act in SUPPORTED_ACTIVATIONS,
            f"hidden_act {self.hidden_act!r} is not one of {SUPPORTED_ACTIVATIONS}",
        )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            need(0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value!r}")
        need(
            0 <= self.pad_token_id < self.vocab_size,
            f"pad_token_id {self.pad_token_id} is outside the vocabulary of {self.vocab_size}",
        )
        if self.case_type_ids:
            object.__setattr__(self, "case_type_ids", int(self.case_type_ids))  # true: scheme 1
            segments = CASE_SEGMENTS.get(self.case_type_ids)
            need(
                segments is not None,
                f"case_type_ids must be one of {sorted(CASE_SEGMENTS)} (or 0: off), "
                f"got {self.case_type_ids!r}",
            )
            need(
                self.type_vocab_size >= (segments or 0),
                f"case_type_ids {self.case_type_ids} needs type_vocab_size >= {segments}, "
                f"got {self.type_vocab_size}",
            )
        need(self.layer_norm_eps > 0, f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        if self.id2label is not None:
            # JSON object keys are strings: normalise to int ids 0..n-1.
            id2label = {int(k): str(v) for k, v in self.id2label.items()}
            need(
                sorted(id2label) == list(range(len(id2label))),
                f"id2label ids must be 0..n-1, got {sorted(id2label)}",
            )
            object.__setattr__(self, "id2label", id2label)
            label2id = {v: k for k, v in id2label.items()}
            need(len(label2id) == len(id2label), f"id2label has repeated labels: {id2label}")
            if self.label2id is not None:
                given = {str(k): int(v) for k, v in self.label2id.items()}
                need(given == label2id, f"label2id {given} does not invert id2label {id2label}")
            object.__setattr__(self, "label2id", label2id)
        elif self.label2id is not None:
            raise ValueError("invalid BertConfig: label2id given without id2label")
        if self.architectures is not None:
            object.__setattr__(self, "architectures", tuple(self.architectures))

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def family(self) -> Family:
        return family(self.model_type)

    @property
    def embedding_width(self) -> int:
        """The embeddings' width: ELECTRA's embedding_size, else hidden_size."""
        return self.embedding_size or self.hidden_size

    @property
    def position_offset(self) -> int:
        """The first position id: RoBERTa's family counts from padding_idx + 1."""
        return self.pad_token_id + 1 if self.family.offset_positions else 0

    @property
    def max_sequence(self) -> int:
        """The longest input the position table covers."""
        return self.max_position_embeddings - self.position_offset

    @property
    def num_labels(self) -> int:
        return len(self.id2label) if self.id2label else 0

    def replace(self, **changes: Any) -> BertConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BertConfig:
        model_type = data.get("model_type", "bert")
        fam = family(model_type)
        if model_type == "distilbert":
            data = {
                ours: data[theirs] for ours, theirs in DISTILBERT_KEYS.items() if theirs in data
            } | {k: v for k, v in data.items() if k not in DISTILBERT_KEYS.values()}
            data["type_vocab_size"] = 0
            if data.get("tie_weights_") is False:
                raise ValueError(
                    "config.json has tie_weights_=False; only a tied MLM head is supported"
                )
        if data.get("architectures"):
            data["architectures"] = [fam.head_of(a) or a for a in data["architectures"]]
        for key, wanted in _REQUIRED_VALUES.items():
            if key in data and data[key] != wanted:
                raise ValueError(
                    f"config.json has {key}={data[key]!r}; only {wanted!r} is supported"
                )
        names = {f.name for f in dataclasses.fields(cls)}
        ignored = sorted(set(data) - names - set(_REQUIRED_VALUES) - {"model_type"})
        if ignored:
            log.debug("config.json keys with no effect on this model: %s", ", ".join(ignored))
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """config.json in the family's own names (what its transformers class reads)."""
        data = dataclasses.asdict(self)
        fam = self.family
        if self.architectures is not None:
            data["architectures"] = [fam.heads.get(a, a) for a in self.architectures]
        for key in (
            "id2label",
            "label2id",
            "architectures",
            "classifier_dropout",
            "embedding_size",
        ):
            if data[key] is None:
                del data[key]
        if self.id2label is not None:
            data["id2label"] = {str(k): v for k, v in self.id2label.items()}
        if self.model_type == "distilbert":
            del data["type_vocab_size"]
            data = {DISTILBERT_KEYS.get(k, k): v for k, v in data.items()}
            data |= {"sinusoidal_pos_embds": False, "tie_weights_": True}
        else:
            data["position_embedding_type"] = "absolute"
        return data

    @classmethod
    def from_json_file(cls, path: str | Path) -> BertConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", "utf-8")


__all__ = ["SUPPORTED_ACTIVATIONS", "BertConfig"]
