"""Training recipes: one TOML file per shipped model, resolved once into frozen dataclasses and
saved beside every checkpoint, so a weight always carries the exact settings that made it."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

RECIPES_DIR = Path(__file__).parent / "recipes"


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1


@dataclass(frozen=True)
class DataSettings:
    vocab_size: int = 16384
    lowercase: bool = False  # cased: NER reads capitals
    max_seq_len: int = 128
    short_seq_prob: float = 0.1
    sentence_pair_prob: float = 0.0  # documents cut into single-sentence pairs instead (/nsp's)
    max_predictions: int = 20  # >= 15% of max_seq_len
    heldout_fraction: float = 0.02  # whole documents, by hash of the page id
    dupe_factor: int = 1  # passes of pair building over the corpus, each with other cuts
    max_docs: int = 0  # 0 = every document (tests use a handful)
    eval_pairs: int = 2000  # held-out pairs scored at each evaluation
    final_eval_pairs: int = 0  # held-out pairs scored at the end (eval.json); 0 = all of them
    # Passes of pair building over CoNLL-2003's Reuters training stories (`pretrain --news DIR`),
    # mixed into the training pairs: news text beside Wikipedia. 0 = Wikipedia only.
    news_copies: int = 0


@dataclass(frozen=True)
class TrainSettings:
    micro_batch: int = 64  # sequences per forward/backward on one process
    accumulation: int = 1  # micro-batches per optimizer step
    max_steps: int = 1000
    lr: float = 1e-3
    warmup_fraction: float = 0.06
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    clip: float = 1.0
    eval_every: int = 500
    checkpoint_every: int = 250
    log_every: int = 10
    seed: int = 1234
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default (all cores)
    # Continued pre-training: the embeddings and the first N encoder layers stay as the init
    # checkpoint has them (no gradients: cheaper steps, and the tied decoder keeps its vocabulary
    # space). 0 trains everything.
    frozen_layers: int = 0


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    # A published or earlier checkpoint to continue from (a directory or an installed package, as
    # `finetune --init`): its vocabulary and shape replace [data] vocab_size/lowercase and the
    # [model] shape; [model]'s dropout still applies. "" = pre-train from scratch.
    init: str = ""
    model: ModelShape = field(default_factory=ModelShape)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str) -> Recipe:
        parts: dict[str, Any] = {}
        for key, kind in (("model", ModelShape), ("data", DataSettings), ("train", TrainSettings)):
            section = data.get(key, {})
            check_keys(kind, section, f"recipe {name!r} [{key}]")
            parts[key] = kind(**section)
        unknown = sorted(set(data) - {"model", "data", "train", "description", "name", "init"})
        if unknown:
            raise ValueError(f"recipe {name!r}: unknown top-level keys {unknown}")
        return cls(
            name=data.get("name", name),
            description=data.get("description", ""),
            init=data.get("init", ""),
            **parts,
        )

    @classmethod
    def load(cls, name_or_path: str | Path) -> Recipe:
        """A recipe by name (`cpu`, `gpu`, `tiny`, ...: a file in recipes/) or by path."""
        name, values = read_recipe(name_or_path)
        return cls.from_dict(values, name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_recipe(name_or_path: str | Path) -> tuple[str, dict[str, Any]]:
    """(name, TOML contents) of a recipe given by name (a file in recipes/) or by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = RECIPES_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))
        raise ValueError(f"no recipe {name_or_path!r} (known: {known}, or a path to a .toml)")
    with open(path, "rb") as f:
        return path.stem, tomllib.load(f)


class FlatRecipe:
    """A recipe dataclass whose TOML file holds its fields as they are (fine-tuning,
    distillation, reranking): `load` reads one by name or path, refusing unknown keys."""

    @classmethod
    def load(cls, name_or_path: str | Path) -> Self:
        name, values = read_recipe(name_or_path)
        check_keys(cls, values, f"recipe {name!r}")
        return cls(**{"name": name, **values})


def check_keys(kind: type, values: dict[str, Any], where: str) -> None:
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(kind)})
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown}")
