"""Tiny transformers checkpoints with a matching 99-token vocabulary, and bundles made of them."""

# ruff: noqa: SIM905
from __future__ import annotations

import string
from pathlib import Path

import torch
import transformers

WORDS = (
    "the a of and to in is was film movie good bad great dull fox dog who what where when "
    "paris france london city river king queen born year first"
).split()
HF_CLASSES = {
    "BertForPreTraining": transformers.BertForPreTraining,
    "BertForSequenceClassification": transformers.BertForSequenceClassification,
    "BertForTokenClassification": transformers.BertForTokenClassification,
    "BertForQuestionAnswering": transformers.BertForQuestionAnswering,
}
TEXTS = [
    "the film was good",
    "who was the first king of france ?",
    "a dull movie , a bad year",
    "paris",
    "the dog and the fox were born in london , a city on a river . " * 4,
]


def write_vocab(path: Path) -> None:
    pieces = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *string.ascii_lowercase,
        *(f"##{c}" for c in string.ascii_lowercase),
        ",",
        ".",
        "?",
        "!",
        *WORDS,
    ]
    pieces = list(dict.fromkeys(pieces))  # "a" is a letter and a word
    assert len(pieces) <= 99
    pieces += [f"[unused{i}]" for i in range(99 - len(pieces))]
    path.write_text("\n".join(pieces) + "\n")


# The tiny BERT of the unit tests (a 99-piece vocabulary: write_vocab), for transformers' config
# here and for ours (tests/conftest.py tiny_config).
TINY_SHAPE = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
}


def hf_checkpoint(directory: Path, architecture: str, seed: int = 0) -> Path:
    labels = {
        "BertForSequenceClassification": ["negative", "positive", "neutral"],
        "BertForTokenClassification": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"],
    }.get(architecture)
    config = transformers.BertConfig(
        **TINY_SHAPE,
        max_position_embeddings=128,
        **(
            {"id2label": dict(enumerate(labels)), "label2id": {v: i for i, v in enumerate(labels)}}
            if labels
            else {}
        ),
    )
    torch.manual_seed(seed)
    model = HF_CLASSES[architecture](config).eval()
    # Random init gives near-tied logits; spread the heads so argmax comparisons mean something.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("classifier", "qa_outputs", "cls.seq_relationship")):
                param.mul_(20)
    model.save_pretrained(directory, safe_serialization=True)
    write_vocab(directory / "vocab.txt")
    return directory


def cross_encoder(directory: Path) -> Path:
    """A tiny cross-encoder: a one-output BertForSequenceClassification, as sentence-transformers'
    CrossEncoder saves one, with scores spread wide enough that their order means something."""
    config = transformers.BertConfig(**TINY_SHAPE, max_position_embeddings=64, num_labels=1)
    torch.manual_seed(3)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(20)
    model.save_pretrained(directory, safe_serialization=True)
    write_vocab(directory / "vocab.txt")
    return directory


def make_checkpoints(root: Path) -> dict[str, Path]:
    return {name: hf_checkpoint(root / name, name) for name in HF_CLASSES}
