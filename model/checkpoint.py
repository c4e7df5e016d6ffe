"""Checkpoints in the Hugging Face format: `config.json` + `model.safetensors`.

Our parameter names are Hugging Face's BERT names, so saving a BERT is writing the state dict and
loading one is reading it; another family's names (DistilBERT, RoBERTa, XLM-R, ELECTRA) are
translated by its rules (model/families.py) both ways. Plus the repairs that real checkpoints need:

- TF-era LayerNorm names (`gamma`/`beta`) become `weight`/`bias`;
- a bare encoder (`embeddings.*`, as `BertModel.save_pretrained` writes) gets its family's prefix;
- the tied MLM decoder (`cls.predictions.decoder.weight`, the word embeddings again) and its bias
  alias are dropped, as is the old `position_ids` buffer;
- a head absent from the checkpoint is initialised fresh and said so in a log line, and other
  heads' weights (a pre-training checkpoint loaded for classification) are dropped, also logged.

An unknown key, a missing encoder key or a shape mismatch is a `CheckpointError` naming the key.
`pytorch_model.bin` is read with `torch.load(weights_only=True)`: never unpickle arbitrary objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from bertserve.model.config import BertConfig
from bertserve.model.heads import HEADS, BertPreTrainedModel

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
PYTORCH_NAME = "pytorch_model.bin"
# Keys that belong to some head: present in a checkpoint and absent from the model we build is
# fine (dropped), absent from the checkpoint and present in the model is fine (initialised).
HEAD_PREFIXES = (
    "cls.predictions.",
    "cls.seq_relationship.",
    "classifier.",
    "qa_outputs.",
    "bert.pooler.",
    "discriminator_predictions.",
)
_DROPPED = ("bert.embeddings.position_ids", "cls.predictions.decoder.bias")
_TIED = "cls.predictions.decoder.weight"
_SEGMENTS = "bert.embeddings.token_type_embeddings.weight"
_WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded into our model; the message names the cause."""


def weights_path(directory: str | Path) -> Path:
    directory = Path(directory)
    for name in (SAFETENSORS_NAME, PYTORCH_NAME):
        if (directory / name).is_file():
            return directory / name
    raise CheckpointError(f"{directory} has neither {SAFETENSORS_NAME} nor {PYTORCH_NAME}")


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_config(directory: str | Path) -> Any:
    """The checkpoint's config: a BertConfig, or an encoder of its own's (OWN_MODEL_TYPES)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_NAME}")
    own = own_encoder(model_type(path))
    return own[0].from_json_file(path) if own else BertConfig.from_json_file(path)


def model_type(config_path: Path) -> str | None:
    try:
        return json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def own_encoder(kind: str | None) -> tuple[Any, Any] | None:
    """The config class and loader of an encoder of its own (OWN_MODEL_TYPES), else None."""
    if kind == "modernbert":
        from bertserve.model import modernbert

        return modernbert.ModernBertConfig, modernbert.load_modernbert
    if kind == "deberta-v2":
        from bertserve.model import deberta

        return deberta.DebertaV2Config, deberta.load_deberta
    return None


def read_state_dict(
    directory: str | Path, config: BertConfig | None = None, head: str = "BertModel"
) -> dict[str, Tensor]:
    """The checkpoint's tensors with their names normalised to ours (Hugging Face's BERT names),
    from the family of `config` (read from the directory if not given) as `head` names them."""
    config = config or read_config(directory)
    path = weights_path(directory)
    if path.name == SAFETENSORS_NAME:
        raw = load_file(path)
    else:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} holds a {type(raw).__name__}, not a state dict")
    return normalise_keys(raw, config, head)


def normalise_keys(
    raw: dict[str, Tensor], config: BertConfig | None = None, head: str = "BertModel"
) -> dict[str, Tensor]:
    family = (config or BertConfig()).family
    bare = not any(k.startswith(family.prefix) for k in raw) and any(
        k.startswith("embeddings.") for k in raw
    )
    state: dict[str, Tensor] = {}
    for key, tensor in family.to_ours(
        {f"{family.prefix}{k}" if bare else k: v for k, v in raw.items()}, head
    ).items():
        if "LayerNorm." in key:
            key = key.removesuffix(".gamma") + ".weight" if key.endswith(".gamma") else key
            key = key.removesuffix(".beta") + ".bias" if key.endswith(".beta") else key
        state[key] = tensor
    for key in _DROPPED:
        state.pop(key, None)
    tied = state.pop(_TIED, None)
    if (
        tied is not None
        and _WORD_EMBEDDINGS in state
        and not torch.equal(tied, state[_WORD_EMBEDDINGS])
    ):
        raise CheckpointError(
            f"{_TIED} differs from {_WORD_EMBEDDINGS}: an untied MLM decoder is not supported"
        )
    return state


def head_class(config: BertConfig, head: str | None) -> type[BertPreTrainedModel]:
    """The model class to build: `head` if given, else the checkpoint's `architectures`."""
    name = head or (config.architectures[0] if config.architectures else None)
    if name is None:
        raise CheckpointError(
            "the checkpoint's config names no architecture: say which head to load"
        )
    if name not in HEADS:
        raise CheckpointError(f"unknown head {name!r}; known heads: {', '.join(HEADS)}")
    return HEADS[name]


def load_model(
    directory: str | Path, head: str | None = None, weights: bool = True, **overrides: object
) -> BertPreTrainedModel:
    """Load a checkpoint directory (ours or Hugging Face's) into `head` (a class name in HEADS).
    `overrides` change the config (labels, dropout) before the model is built; `weights=False`
    keeps BERT's random initialisation (the no-pre-training baseline) with the same shape."""
    config = read_config(directory)
    own = own_encoder(config.model_type)
    if own is not None:
        if overrides or not weights:
            raise CheckpointError(
                f"{config.model_type} checkpoints load for export and serving only"
            )
        return own[1](directory, head)
    cls = head_class(config, head)
    state = read_state_dict(directory, config, cls.architecture) if weights else {}
    classifier = state.get("classifier.weight")
    if cls.needs_labels and not config.num_labels and classifier is not None:
        # transformers leaves id2label out of config.json when it is its default (LABEL_0,
        # LABEL_1): the head's rows say how many labels there are, named as transformers does.
        config = config.replace(id2label={i: f"LABEL_{i}" for i in range(len(classifier))})
    model = cls(config.replace(architectures=(cls.architecture,), **overrides))
    if not weights:
        return model
    expected = {k: v for k, v in model.state_dict().items() if k != _TIED}

    unknown = [k for k in state if k not in expected and not k.startswith(HEAD_PREFIXES)]
    if unknown:
        raise CheckpointError(f"unknown key in {directory}: {unknown[0]} ({len(unknown)} in all)")
    grown = expected.get(_SEGMENTS)
    if grown is not None and _SEGMENTS in state and len(state[_SEGMENTS]) < len(grown):
        # More segment ids than the checkpoint has (case_type_ids): each new one starts as
        # segment 0, so the model first computes what it did, and training tells them apart.
        table = state[_SEGMENTS]
        extra = table[:1].expand(len(grown) - len(table), -1)
        state[_SEGMENTS] = torch.cat([table, extra])
        log.info("segment embeddings: %d rows grown to %d from row 0", len(table), len(grown))
    for key, tensor in state.items():
        if key in expected and tensor.shape != expected[key].shape:
            raise CheckpointError(
                f"shape mismatch for {key}: checkpoint {tuple(tensor.shape)}, "
                f"model {tuple(expected[key].shape)}"
            )
    missing = [k for k in expected if k not in state]
    missing_body = [k for k in missing if not k.startswith(HEAD_PREFIXES)]
    if missing_body:
        raise CheckpointError(
            f"missing key in {directory}: {missing_body[0]} ({len(missing_body)} in all)"
        )
    if missing:
        log.info("initialised (not in the checkpoint): %s", ", ".join(missing))
    unused = [k for k in state if k not in expected]
    if unused:
        log.info("dropped (another head's weights): %s", ", ".join(unused))

    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    model.tie_weights()
    return model


def save_model(model: BertPreTrainedModel, directory: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` in the model's family's names; returns the
    weights file. The tied decoder weight is left out (it is the word embeddings), as
    `transformers` does."""
    directory = Path(directory)
    family = model.config.family
    if model.architecture not in family.heads:
        raise CheckpointError(
            f"{family.model_type} has no {model.architecture} head; "
            f"its heads: {', '.join(family.heads.values())}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    model.config.replace(architectures=(model.architecture,)).to_json_file(directory / CONFIG_NAME)
    ours = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != _TIED}
    state = family.to_theirs(ours, model.architecture)
    path = directory / SAFETENSORS_NAME
    save_file(state, path, metadata={"format": "pt"})
    return path
