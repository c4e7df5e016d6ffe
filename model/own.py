"""What the encoders written apart from model/bert.py (ModernBERT: model/modernbert.py,
DeBERTa-v2/v3: model/deberta.py) share: a config that reads and writes Hugging Face's
config.json keys, and checkpoints read and written in Hugging Face's names, with no renaming."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

C = TypeVar("C", bound="OwnConfig")


class OwnConfig:
    """A frozen dataclass's config.json side (mixed into ModernBertConfig, DebertaV2Config)."""

    MODEL_TYPE: ClassVar[str]
    id2label: dict[int, str] | None
    architectures: tuple[str, ...] | None

    @property
    def num_labels(self) -> int:
        return len(self.id2label) if self.id2label else 2

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """A config.json's keys; those of Hugging Face's that change nothing here are dropped."""
        if data.get("model_type", cls.MODEL_TYPE) != cls.MODEL_TYPE:
            raise ValueError(
                f"config.json has model_type {data['model_type']!r}, not {cls.MODEL_TYPE}"
            )
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        values = cls.adapt({k: v for k, v in data.items() if k in known})
        if values.get("id2label") is not None:
            values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
        if values.get("architectures") is not None:
            values["architectures"] = tuple(values["architectures"])
        return cls(**values)

    @classmethod
    def adapt(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The config's own reading of its keys (DeBERTa's pos_att_type)."""
        return values

    @classmethod
    def from_json_file(cls: type[C], path: str | Path) -> C:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)  # type: ignore[call-overload]
        data["architectures"] = list(self.architectures) if self.architectures else None
        return data


def read_checkpoint(
    directory: Path,
    config_class: type[C],
    heads: dict[str, Any],
    ours: dict[str, str],
    head: str | None,
) -> tuple[C, str, dict[str, Tensor]]:
    """A checkpoint directory's config, the head class name to build (`head` in ours or its
    names, default the config's architecture) and its tensors. transformers leaves id2label out
    of config.json at its default (LABEL_0, LABEL_1): the classifier's rows then say how many
    labels there are, named as transformers names them."""
    from safetensors.torch import load_file

    config = config_class.from_json_file(directory / "config.json")
    bare = next(iter(heads))
    name = head or (config.architectures[0] if config.architectures else bare)
    name = ours.get(name, name)
    if name not in heads:
        raise ValueError(
            f"unknown {config_class.MODEL_TYPE} head {name!r}; known: {', '.join(heads)}"
        )
    state = load_file(directory / "model.safetensors")
    classifier = state.get("classifier.weight")
    if config.id2label is None and classifier is not None and name.endswith("Classification"):
        labels = {i: f"LABEL_{i}" for i in range(len(classifier))}
        config = dataclasses.replace(config, id2label=labels)  # type: ignore[type-var]
    return config, name, state


def check_fits(
    directory: Path, name: str, model: nn.Module, state: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The tensors `model` takes; every one it takes must be there, and none other."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise ValueError(
            f"{directory}: the checkpoint does not fit {name}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    return state


def save_checkpoint(model: Any, directory: str | Path, prefix: str, tied: str) -> Path:
    """config.json and model.safetensors as Hugging Face writes them: the tied decoder (`tied`)
    left out, and a bare encoder's keys without its `prefix`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(model.config, architectures=(model.architecture,))
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != tied}
    if "For" not in model.architecture:  # the bare encoder
        state = {k.removeprefix(prefix): v for k, v in state.items()}
    path = directory / "model.safetensors"
    save_file(state, path)
    return path
