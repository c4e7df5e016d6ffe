"""sentence-transformers' `SparseEncoder` directories, read for export: where the MLM encoder is,
how `SpladePooling` pools, and an inference-free side (`SparseStaticEmbedding` in a `Router`).

Two layouts, as sentence-transformers 5.7 saves them:
- `Transformer` (fill-mask; `MLMTransformer` before 5.4) at the root, then `1_SpladePooling`;
- a `Router` (router_config.json) whose routes "query" and "document" each hold either that
  pair (in `document_0_Transformer`, `document_1_SpladePooling`) or one `SparseStaticEmbedding`
  (a learned weight a vocabulary id, in `query_0_SparseStaticEmbedding/model.safetensors`):
  the "inference-free" SPLADE models, whose queries need no encoder pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bertserve.export.graph import ExportError, read_model_max_length

ENCODER_TYPES = ("Transformer", "MLMTransformer")


@dataclass
class SparseSource:
    encoder: Path  # the directory of the MLM checkpoint (config.json, weights, tokenizer)
    settings: dict[str, Any]  # bundle.json "sparse", less the static side's file
    static_weights: np.ndarray | None = None  # float32, one a vocabulary id


def _kind(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def _pooling(directory: Path) -> dict[str, str]:
    config = json.loads((directory / "config.json").read_text())
    pooling = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if pooling not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
        raise ExportError(
            f"{directory}: SpladePooling {pooling}/{activation}: only max or sum pooling of relu "
            "or log1p_relu is supported"
        )
    return {"pooling": pooling, "activation": activation}


def _encoder_route(root: Path, modules: list[tuple[str, str]]) -> tuple[Path, dict[str, str]]:
    """The (encoder directory, pooling) of a route of [Transformer, SpladePooling]."""
    kinds = [_kind(t) for _, t in modules]
    if len(kinds) != 2 or kinds[0] not in ENCODER_TYPES or kinds[1] != "SpladePooling":
        raise ExportError(
            f"{root}: modules {kinds}: a sparse encoder is a Transformer (fill-mask) followed by "
            "SpladePooling (SparseEncoder's MLMTransformer + SpladePooling)"
        )
    return root / modules[0][0], _pooling(root / modules[1][0])


def _static(directory: Path) -> tuple[np.ndarray, int | None]:
    from safetensors.numpy import load_file

    path = directory / "model.safetensors"
    if not path.is_file():
        raise ExportError(f"{path}: missing (SparseStaticEmbedding's weights)")
    weights = load_file(str(path)).get("weight")
    if weights is None or weights.ndim != 1:
        raise ExportError(f"{path}: no 1-d 'weight' (one weight a vocabulary id)")
    return weights.astype(np.float32), read_model_max_length(directory)


def read_sparse_encoder(root: Path) -> SparseSource:
    """Where a SparseEncoder directory keeps its encoder and pooling, and its static side."""
    modules_path = root / "modules.json"
    if not modules_path.is_file():  # a bare MLM checkpoint: SPLADE's defaults
        return SparseSource(root, {"pooling": "max", "activation": "relu"})
    listed = [(m.get("path", ""), m.get("type", "")) for m in json.loads(modules_path.read_text())]
    if len(listed) != 1 or _kind(listed[0][1]) != "Router":
        encoder, pooling = _encoder_route(root, listed)
        return SparseSource(encoder, pooling)
    config_path = root / listed[0][0] / "router_config.json"
    config = json.loads(config_path.read_text())
    types, structure = config["types"], config["structure"]
    routes = {r: [(name, types[name]) for name in names] for r, names in structure.items()}
    if sorted(routes) != ["document", "query"]:
        raise ExportError(f"{config_path}: routes {sorted(routes)}; query and document are served")
    static = [
        r for r, ms in routes.items() if [_kind(t) for _, t in ms] == ["SparseStaticEmbedding"]
    ]
    encoded = [r for r in routes if r not in static]
    if len(static) != 1 or len(encoded) != 1:
        raise ExportError(
            f"{config_path}: one route must be a SparseStaticEmbedding and the other a SPLADE "
            f"encoder (an inference-free model); routes {routes}"
        )
    base = root / listed[0][0]
    encoder, pooling = _encoder_route(base, routes[encoded[0]])
    weights, max_len = _static(base / routes[static[0]][0][0])
    default = config.get("parameters", {}).get("default_route") or encoded[0]
    settings = pooling | {
        "static_side": static[0],
        "static_max_len": max_len,
        "default_side": default,
    }
    return SparseSource(encoder, settings, weights)
