"""PyLate `ColBERT` directories, read for export: the encoder, its projection (PyLate's `Dense`
layers), and the framing of queries and documents (config_sentence_transformers.json), as
PyLate 1.6 saves them:

- the encoder at the root (modules.json: `sentence_transformers.models.Transformer`, path ""),
  its tokenizer holding the side markers ("[unused0]"/"[unused1]", or "[Q] "/"[D] " added);
- one or more `pylate.models.Dense.Dense` (or sentence-transformers `Dense`) folders, each
  `activation(linear(x))` (+ x, or a linear of x, with `use_residual`);
- `query_prefix`, `document_prefix`, `query_length`, `document_length`, `do_query_expansion`,
  `attend_to_expansion_tokens`, `skiplist_words`: what `ColBERT.tokenize` / `encode` read.

A marker or skiplist word the tokenizer does not hold maps to its unknown id, as transformers'
`convert_tokens_to_ids` maps it (PyLate then skips the unknown id in documents too).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from bertserve.export.graph import ExportError

ENCODER_TYPES = ("Transformer",)
DENSE_TYPES = ("Dense",)
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
}


class DenseLayer(nn.Module):
    """One PyLate Dense layer."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        from safetensors.torch import load_file

        config = json.loads((directory / "config.json").read_text())
        activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
        if activation not in ACTIVATIONS:
            raise ExportError(
                f"{directory}: activation {activation}; served: {', '.join(ACTIVATIONS)}"
            )
        weights_path = directory / "model.safetensors"
        if not weights_path.is_file():
            raise ExportError(f"{weights_path}: missing (the projection's weights)")
        state = load_file(str(weights_path))
        self.linear = nn.Linear(
            int(config["in_features"]), int(config["out_features"]), bool(config.get("bias"))
        )
        self.activation = ACTIVATIONS[activation]()
        self.residual: nn.Module | None = None
        if config.get("use_residual"):
            same = config["in_features"] == config["out_features"]
            self.residual = (
                nn.Identity()
                if same
                else nn.Linear(int(config["in_features"]), int(config["out_features"]), False)
            )
        missing = self.load_state_dict(state, strict=False)
        if missing.missing_keys or missing.unexpected_keys:
            raise ExportError(
                f"{weights_path}: weights {sorted(state)} do not fit the layer "
                f"({missing.missing_keys or missing.unexpected_keys})"
            )
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        out = self.activation(self.linear(x))
        return out if self.residual is None else out + self.residual(x)


@dataclass
class ColbertSource:
    encoder: Path
    projection: nn.Sequential
    settings: dict[str, Any]  # bundle.json "multivector"


def _kind(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def read_colbert(root: Path, tokenizer: Any) -> ColbertSource:
    """A PyLate ColBERT directory's encoder, projection and framing; `tokenizer`: its
    `tokenizers.Tokenizer` (the markers' and skiplist's ids)."""
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        raise ExportError(f"{root}: no modules.json (a PyLate ColBERT directory has one)")
    listed = [
        (m.get("path", ""), _kind(m.get("type", ""))) for m in json.loads(modules_path.read_text())
    ]
    if (
        len(listed) < 2
        or listed[0][1] not in ENCODER_TYPES
        or any(k not in DENSE_TYPES for _, k in listed[1:])
    ):
        raise ExportError(
            f"{root}: modules {[k for _, k in listed]}: a ColBERT is a Transformer followed by "
            "Dense projections (PyLate's layout)"
        )
    layers = [DenseLayer(root / p) for p, _ in listed[1:]]
    projection = nn.Sequential(*layers)
    dim = layers[-1].linear.out_features
    config = json.loads((root / "config_sentence_transformers.json").read_text())
    unk = tokenizer.token_to_id("[UNK]") if tokenizer.token_to_id("[UNK]") is not None else 0

    def token_id(token: str) -> int:
        found = tokenizer.token_to_id(token)
        return unk if found is None else int(found)

    def marker(name: str, default: str) -> int | None:
        value = config.get(name)
        value = default if value is None else value
        return None if value == "" else token_id(value)

    mask = tokenizer.token_to_id("[MASK]")
    if mask is None:
        mask = tokenizer.token_to_id("<mask>")
    if mask is None:
        raise ExportError(f"{root}: the tokenizer has no mask token to expand queries with")
    expansion = bool(config.get("do_query_expansion", True))
    skiplist = config.get("skiplist_words")
    words = list(string.punctuation) if skiplist is None else [str(w) for w in skiplist]
    settings = {
        "dim": dim,
        "query_prefix_id": marker("query_prefix", "[Q] "),
        "document_prefix_id": marker("document_prefix", "[D] "),
        "query_length": int(config.get("query_length") or 32),
        "document_length": int(config.get("document_length") or 180),
        "query_expansion": expansion,
        "attend_to_expansion": expansion and bool(config.get("attend_to_expansion_tokens")),
        "expansion_id": int(mask),
        "skip_ids": sorted({token_id(w) for w in words}),
    }
    return ColbertSource(root, projection, settings)
