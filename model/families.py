"""Encoder families: the checkpoints built on BERT's encoder, as variants of model/bert.py.

DistilBERT, RoBERTa (and XLM-RoBERTa, CamemBERT) and ELECTRA run BERT's post-LN blocks; what
differs is small, named here, and read by the modules as config properties:

| family       | segments | positions    | first-token head         | MLM head               |
|--------------|----------|--------------|--------------------------|------------------------|
| bert         | 2        | 0..S-1       | dense + tanh (pooler)    | dense, act, LN         |
| distilbert   | none     | 0..S-1       | dense + ReLU             | dense, act, LN         |
| roberta, xlm | 1        | pad+1..pad+S | dense + tanh             | dense, act, LN         |
| electra      | 2        | 0..S-1       | dense + GELU             | dense to E, act, LN(E) |

ELECTRA's embeddings are E wide (`embedding_size`) and projected to the hidden width.

Our modules keep BERT's (Hugging Face's) names, so a BERT checkpoint is its state dict. Every other
family's names are translated by prefix rules, in order, the first match winning, both ways: what
our sentence head calls `bert.pooler.dense` is RoBERTa's `classifier.dense` and DistilBERT's
`pre_classifier`. A sequence classifier's dense + activation on the first token, followed by
dropout and a projection, computes what BERT's pooler + classifier compute, so one module serves
them all; only its activation differs.

The family is `config.json`'s `model_type`; its head classes carry the family's name
(`RobertaForSequenceClassification`), ours BERT's, mapped by `Family.heads`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Our head classes (model/heads.py architecture names), in the order of Hugging Face's suffixes.
_SUFFIXES = {
    "BertModel": "Model",
    "BertForMaskedLM": "ForMaskedLM",
    "BertForSequenceClassification": "ForSequenceClassification",
    "BertForTokenClassification": "ForTokenClassification",
    "BertForQuestionAnswering": "ForQuestionAnswering",
}

Rule = tuple[str, str]  # (our prefix, theirs); "{}" stands for a layer number on both sides


@dataclass(frozen=True)
class Family:
    model_type: str
    classes: str  # Hugging Face's class-name prefix: "Roberta" -> RobertaForMaskedLM
    segments: bool  # whether token_type_ids reach the model (a graph input)
    offset_positions: bool  # positions start after padding_idx (fairseq's convention)
    sentence_activation: str  # of the dense layer on the first token: tanh, relu, gelu
    prefix: str  # the encoder's key prefix in their checkpoints: "roberta." -> our "bert."
    # every head's, after the head's own and before the encoder's prefix (first match wins)
    rules: tuple[Rule, ...] = ()
    head_rules: dict[str, tuple[Rule, ...]] = field(default_factory=dict)  # one head's, first
    extra_heads: dict[str, str] = field(default_factory=dict)  # ours -> theirs, beyond _SUFFIXES
    pooler: bool = True  # whether the bare encoder (BertModel) has one

    @property
    def heads(self) -> dict[str, str]:
        """Our architecture name -> theirs."""
        names = {ours: f"{self.classes}{suffix}" for ours, suffix in _SUFFIXES.items()}
        return names | self.extra_heads

    def head_of(self, theirs: str) -> str | None:
        """Our architecture name for a class name of theirs (None: not one of ours)."""
        return next((o for o, t in self.heads.items() if t == theirs), None)

    def to_theirs(self, state: dict[str, Any], head: str) -> dict[str, Any]:
        return {_rename(k, self._rules(head), 0): v for k, v in state.items()}

    def to_ours(self, state: dict[str, Any], head: str) -> dict[str, Any]:
        return {_rename(k, self._rules(head), 1): v for k, v in state.items()}

    def _rules(self, head: str) -> tuple[Rule, ...]:
        return (*self.head_rules.get(head, ()), *self.rules, ("bert.", self.prefix))


def _rename(key: str, rules: tuple[Rule, ...], side: int) -> str:
    for rule in rules:
        pattern = re.escape(rule[side]).replace(r"\{\}", r"(\d+)")
        match = re.match(pattern, key)
        if match:
            return (
                rule[1 - side].replace("{}", match.group(1) if match.groups() else "")
                + key[match.end() :]
            )
    return key


def _mlm_rules(dense: str, norm: str, bias: str, decoder: str) -> tuple[Rule, ...]:
    """The MLM head's rules: their dense layer, LayerNorm, vocabulary bias (our
    `cls.predictions.bias`) and tied decoder. The bias rule comes first: the decoder's prefix
    may cover it (DistilBERT's `vocab_projector.bias`)."""
    return (
        ("cls.predictions.transform.dense.", dense),
        ("cls.predictions.transform.LayerNorm.", norm),
        ("cls.predictions.bias", bias),
        ("cls.predictions.decoder.", decoder),
    )


def _roberta(model_type: str, classes: str) -> Family:
    """fairseq's BERT: one segment, positions offset past the padding id, an LM head of its own
    names and a sentence head on <s> with its own dense layer (RobertaClassificationHead)."""
    return Family(
        model_type=model_type,
        classes=classes,
        prefix="roberta.",
        segments=False,
        offset_positions=True,
        sentence_activation="tanh",
        rules=(
            *_mlm_rules(
                "lm_head.dense.", "lm_head.layer_norm.", "lm_head.bias", "lm_head.decoder."
            ),
        ),
        head_rules={"BertForSequenceClassification": _SENTENCE_HEAD},
    )


def _layer_rules(theirs: str, *names: Rule) -> tuple[Rule, ...]:
    """Rules for the blocks' keys: `theirs` is their block prefix, "{}" the layer number."""
    return tuple((f"bert.encoder.layer.{{}}.{ours}", f"{theirs}{name}") for ours, name in names)


# A sequence classifier's head on the first token, as RoBERTa and ELECTRA name it.
_SENTENCE_HEAD: tuple[Rule, ...] = (
    ("bert.pooler.dense.", "classifier.dense."),
    ("classifier.", "classifier.out_proj."),
)

FAMILIES: dict[str, Family] = {
    "bert": Family(
        model_type="bert",
        classes="Bert",
        prefix="bert.",
        segments=True,
        offset_positions=False,
        sentence_activation="tanh",
        extra_heads={"BertForPreTraining": "BertForPreTraining"},
    ),
    "distilbert": Family(
        model_type="distilbert",
        classes="DistilBert",
        prefix="distilbert.",
        segments=False,
        offset_positions=False,
        sentence_activation="relu",
        pooler=False,
        rules=(
            *_layer_rules(
                "distilbert.transformer.layer.{}.",
                ("attention.self.query.", "attention.q_lin."),
                ("attention.self.key.", "attention.k_lin."),
                ("attention.self.value.", "attention.v_lin."),
                ("attention.output.dense.", "attention.out_lin."),
                ("attention.output.LayerNorm.", "sa_layer_norm."),
                ("intermediate.dense.", "ffn.lin1."),
                ("output.dense.", "ffn.lin2."),
                ("output.LayerNorm.", "output_layer_norm."),
            ),
            ("bert.pooler.dense.", "pre_classifier."),
            *_mlm_rules(
                "vocab_transform.", "vocab_layer_norm.", "vocab_projector.bias", "vocab_projector."
            ),
        ),
    ),
    "roberta": _roberta("roberta", "Roberta"),
    "xlm-roberta": _roberta("xlm-roberta", "XLMRoberta"),
    "camembert": _roberta("camembert", "Camembert"),
    "electra": Family(
        model_type="electra",
        classes="Electra",
        prefix="electra.",
        segments=True,
        offset_positions=False,
        sentence_activation="gelu",
        pooler=False,
        rules=(
            *_mlm_rules(
                "generator_predictions.dense.",
                "generator_predictions.LayerNorm.",
                "generator_lm_head.bias",
                "generator_lm_head.",
            ),
        ),
        head_rules={"BertForSequenceClassification": _SENTENCE_HEAD},
        extra_heads={"BertForReplacedTokenDetection": "ElectraForPreTraining"},
    ),
}

# DistilBERT's config.json names, ours (BERT's) on the left.
DISTILBERT_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "hidden_dim",
    "hidden_act": "activation",
    "hidden_dropout_prob": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "classifier_dropout": "seq_classif_dropout",
}


# Encoders of their own modules and names, not variants of model/bert.py (model/modernbert.py,
# model/deberta.py): model/checkpoint.py loads them apart.
OWN_MODEL_TYPES = ("modernbert", "deberta-v2")


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"config.json has model_type {model_type!r}; supported: "
            f"{', '.join([*FAMILIES, *OWN_MODEL_TYPES])}"
        )
    return FAMILIES[model_type]


__all__ = ["DISTILBERT_KEYS", "FAMILIES", "OWN_MODEL_TYPES", "Family", "family"]
