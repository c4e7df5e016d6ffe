"""`soup`: the element-wise mean of fine-tuned checkpoints of one model ("model soups",
Wortsman et al. 2022): runs fine-tuned from the same published weights stay in one basin, and
their average is often better than each, at no cost when serving.

    bertserve soup --out runs/sst2-soup runs/sst2-a runs/sst2-b

The checkpoints must have the same shape, head, labels and vocabulary, and start from the same
published weights (their `source.json`); anything else is refused with the difference named.
`soup.json` beside the result lists the ingredients and their weight hashes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bertserve.model.checkpoint import load_model, read_config, save_model, sha256, weights_path
from bertserve.model.sources import SOUP_NAME, read_provenance, write_provenance
from bertserve.model.tokenizer import VOCAB_NAME, BertTokenizer

# Training settings that differ between ingredients without changing what the weights mean.
_FREE = {"hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"}


def _describe(directory: Path) -> dict[str, Any]:
    config = dataclasses.asdict(read_config(directory))
    return {k: v for k, v in config.items() if k not in _FREE}


def soup(ingredients: list[Path], out: Path) -> dict[str, Any]:
    if len(ingredients) < 2:
        raise ValueError("a soup needs two or more checkpoints")
    first = ingredients[0]
    shape, provenance = _describe(first), read_provenance(first)
    vocab = (first / VOCAB_NAME).read_bytes() if (first / VOCAB_NAME).is_file() else None
    for other in ingredients[1:]:
        theirs = _describe(other)
        differ = sorted(k for k in shape if shape[k] != theirs.get(k))
        if differ:
            raise ValueError(
                f"{other} differs from {first} in {differ[0]}: "
                f"{theirs.get(differ[0])!r} vs {shape[differ[0]]!r}"
            )
        if read_provenance(other) != provenance:
            raise ValueError(
                f"{other} starts from other published weights than {first} (source.json): "
                "a soup averages fine-tunes of one start"
            )
        if vocab is not None and (other / VOCAB_NAME).read_bytes() != vocab:
            raise ValueError(f"{other} has another vocabulary than {first}")

    model = load_model(first).eval()
    base = model.state_dict()
    total = {k: v.double() for k, v in base.items()}
    for other in ingredients[1:]:
        state = load_model(other).state_dict()
        total = {k: v + state[k].double() for k, v in total.items()}
    model.load_state_dict({k: (v / len(ingredients)).to(base[k].dtype) for k, v in total.items()})
    save_model(model, out)
    BertTokenizer.load(first).save(out)
    if provenance is not None:
        write_provenance(out, provenance)
    summary = {
        "ingredients": [
            {"checkpoint": str(p), "sha256": sha256(weights_path(p))} for p in ingredients
        ],
        "weights": "uniform",
    }
    (out / SOUP_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
