"""A bundle's graph back to a trainable checkpoint: `bertserve checkpoint BUNDLE --out DIR`.

Training that continues across machines needs its weights, and the one copy that lasts is the
shipped bundle (a run's fp32 checkpoint and optimizer state are hundreds of MB, not kept in the
repository). The exporter names each node by the torch module it was traced from, so every
weight is found by the node that uses it:

- a MatMul's weight is stored (in, out): it is transposed back to torch's (out, in);
- ONNX Runtime's fused nodes (SkipLayerNormalization, BiasGelu) carry a LayerNorm and the bias of
  the MatMul beside them;
- ONNX Runtime's fused `Attention` holds one (in, 3 x hidden) weight and bias for query, key and
  value in that order: they are split;
- the word-embedding table is read in any form the exporter writes it (fp32, fp16, int8 rows with
  a scale) and dequantised; a tied MLM decoder is that table again.

What comes back is the graph's weights, so an fp16 or int8-table bundle gives their rounding: the
result is checked against the graph it came from (`torch_parity`) and the figures are returned and
written to `recovered.json` beside the checkpoint. Our BERT-shaped exports only: another family's
graph (DistilBERT, RoBERTa names) or a dynamic-int8 graph (MatMulInteger) is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bertserve.model.checkpoint import save_model, sha256
from bertserve.model.config import BertConfig
from bertserve.model.heads import HEADS
from bertserve.model.sources import Provenance, write_provenance
from bertserve.runtime.bundle import load_bundle_spec

RECOVERED_NAME = "recovered.json"
# Precisions whose every weight comes back: fp32 weights or fp16-stored ones restored by a Cast,
# and a word table in fp32, fp16 or int8 rows. Dynamic int8 MatMuls, 4-bit tables and all-fp16
# graphs are not read back.
RECOVERABLE = ("fp32", "fp16-weights", "fp16-weights-int8-embeddings")


class RecoverError(ValueError):
    """A bundle whose graph cannot be read back into our model; the message says why."""


def _module(node: Any, ours: bool = True) -> str | None:
    """The torch module a node was traced from, as a parameter prefix: torch.onnx names nodes
    by module path ("/bert/encoder/layer.0/output/dense/MatMul"). Our exporter traces a wrapper
    (`ours`): "/model/classifier/Gemm", and the pre-training heads as "/predictions/...",
    "/seq_relationship/..." under `cls`."""
    if not node.name.startswith("/"):
        return None
    parts = node.name.strip("/").split("/")[:-1]
    if ours and parts[:1] == ["model"]:
        parts = parts[1:]
    if ours and parts[:1] in (["predictions"], ["seq_relationship"]):
        parts = ["cls", *parts]
    return ".".join(parts) or None


# The initializers ONNX Runtime's quantiser adds beside an int8 tensor X_quantized: not weights.
_QUANT_PARAMS = ("_scale", "_zero_point", "scales_mul:0")


def _dequantise(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    """(q - zero) * scale, per tensor or per channel along `axis`."""
    shape = [1] * q.ndim
    if scale.ndim == 1 and scale.size > 1:
        shape[axis] = scale.size
    values = q.astype(np.float32) - zero.astype(np.float32).reshape(shape)
    return (values * scale.astype(np.float32).reshape(shape)).astype(np.float32)


def read_weights(graph: Any, ours: bool = True) -> dict[str, np.ndarray]:
    """Every weight the graph computes with, under its module's parameter names and oriented as
    torch holds it, read node by node: by what each node does with it, not by the initializer's
    name, since torch.onnx stores equal tensors once (a fresh model's LayerNorm ones and zeros,
    behind Identity nodes), names a transposed one `onnx::MatMul_302`, and ONNX Runtime's
    fusions name theirs (Attention_3_qkv_weight). A weight stored in fp16 is read through the
    Cast that restores it, an int8 one (ONNX Runtime's dynamic quantiser: X_quantized,
    X_scale, X_zero_point) dequantised. A node holding weights that is not one of those below is
    refused by name. `ours`: the graph is our exporter's (export/graph.py), else a
    transformers model's as torch.onnx or Optimum export it."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def stored(name: str) -> np.ndarray:
        return numpy_helper.to_array(inits[name])

    def value(name: str) -> np.ndarray | None:
        while name not in inits and name in producers:
            node = producers[name]
            if node.op_type not in ("Cast", "Identity"):
                return None
            name = node.input[0]
        if name not in inits or name.endswith(_QUANT_PARAMS):
            return None
        data = stored(name)
        base = name.removesuffix("_quantized")
        if base != name and base + "_scale" in inits and base + "_zero_point" in inits:
            scale, zero = stored(base + "_scale"), stored(base + "_zero_point")
            axis = data.ndim - 1 if scale.size == data.shape[-1] else 0
            return _dequantise(data, scale, zero, axis)
        if data.dtype not in (np.float32, np.float16) or data.ndim == 0:
            return None  # integer buffers (position ids) and scalars (scales, epsilons)
        return data.astype(np.float32)

    def dense(names: list[str]) -> str:
        """The module of the MatMul next to a fused node (producing one of `names`)."""
        for name in names:
            node = producers.get(name)
            if node is not None and node.op_type == "MatMul" and _module(node):
                return str(_module(node))
        raise RecoverError(f"a fused node without its MatMul next to it: {names}")

    out: dict[str, np.ndarray] = {}

    def put(key: str, array: np.ndarray | None) -> None:
        if array is None:
            raise RecoverError(f"no stored weight for {key}")
        if key in out and not np.array_equal(out[key], array):
            raise RecoverError(f"two different weights for {key}")
        out[key] = array

    for node in graph.node:
        weights = [value(name) if name else None for name in node.input]
        if node.op_type in ("Cast", "Identity", "DequantizeLinear") or all(
            w is None for w in weights
        ):
            continue
        op, module = node.op_type, _module(node, ours)
        if op == "Attention":  # its output feeds the layer's attention.output.dense MatMul
            after = [n for n in consumers.get(node.output[0], []) if n.op_type == "MatMul"]
            owner = _module(after[0]) if after else None
            if owner is None or not owner.endswith(".attention.output.dense"):
                raise RecoverError(f"fused attention {node.name!r}: no output projection after it")
            prefix = owner.removesuffix(".output.dense") + ".self"
            for role, index in (("weight", 1), ("bias", 2)):
                array = weights[index]
                assert array is not None, node.name
                for which, part in zip(
                    ("query", "key", "value"), np.split(array, 3, -1), strict=True
                ):
                    put(f"{prefix}.{which}.{role}", part.T.copy() if role == "weight" else part)
        elif op == "SkipLayerNormalization":  # input, skip, gamma, beta, bias of the dense
            block = dense(list(node.input[:2])).removesuffix(".dense")
            put(f"{block}.LayerNorm.weight", weights[2])
            put(f"{block}.LayerNorm.bias", weights[3])
            put(f"{block}.dense.bias", weights[4] if len(weights) > 4 else None)
        elif op in ("BiasGelu", "FastGelu"):
            put(f"{dense([node.input[0]])}.bias", weights[1])
        elif module is None:
            raise RecoverError(f"a {op} node {node.name!r} holds weights this reader does not know")
        elif op in ("MatMul", "MatMulInteger"):
            put(f"{module}.weight", None if weights[1] is None else weights[1].T.copy())
        elif op == "Gemm":
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            matrix = weights[1]
            put(f"{module}.weight", matrix if trans_b or matrix is None else matrix.T.copy())
            if len(weights) > 2 and weights[2] is not None:
                put(f"{module}.bias", weights[2])
        elif op == "LayerNormalization":
            put(f"{module}.weight", weights[1])
            put(f"{module}.bias", weights[2])
        elif op == "Gather":  # position and segment tables (the word table is read apart)
            put(f"{module}.weight", weights[0])
        elif op == "Add":  # a bias added apart: the MLM decoder's, a head's, a quantised dense's
            put(f"{module}.bias", next(w for w in weights if w is not None))
        elif op == "Mul":  # a decomposed LayerNorm's scale
            put(f"{module}.weight", next(w for w in weights if w is not None))
        else:
            raise RecoverError(f"a {op} node {node.name!r} holds weights this reader does not know")
    return out


def _config(weights: dict[str, np.ndarray], graph: Any, spec: Any) -> BertConfig:
    """The model's shape, from the bundle's architecture and the weights' own shapes."""
    arch = spec.architecture
    layer0 = weights.get("bert.encoder.layer.0.intermediate.dense.weight")
    segments = weights.get("bert.embeddings.token_type_embeddings.weight")
    if layer0 is None or segments is None:
        raise RecoverError("the graph lacks the first layer's feed-forward or the segment table")
    eps = [
        a.f
        for n in graph.node
        if n.op_type in ("SkipLayerNormalization", "LayerNormalization")
        for a in n.attribute
        if a.name == "epsilon"
    ]
    fast = any(n.op_type in ("FastGelu", "BiasGeluFast") for n in graph.node)
    return BertConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        intermediate_size=int(layer0.shape[0]),
        hidden_act="gelu_new" if fast else "gelu",
        max_position_embeddings=arch.max_position_embeddings,
        type_vocab_size=int(segments.shape[0]),
        layer_norm_eps=float(eps[0]) if eps else 1e-12,
        pad_token_id=spec.tokenizer.pad_id,
        case_type_ids=spec.tokenizer.case_type_ids,
        id2label=dict(enumerate(spec.labels)) if spec.labels else None,
        label2id={label: i for i, label in enumerate(spec.labels)} if spec.labels else None,
    )


def checkpoint_from_bundle(directory: Path, out: Path) -> dict[str, Any]:
    """Write `out` (config.json, model.safetensors, tokenizer.json, source.json) from the
    bundle's graph, check it against that graph, and return the check with what was read."""
    import onnx

    from bertserve.export.bundle import bundle_tokenizer, torch_parity
    from bertserve.export.variants import _drop_unused_initializers, _take_word_table

    spec = load_bundle_spec(directory)
    if spec.architecture.model_type != "bert":
        raise RecoverError(
            f"{directory}: a {spec.architecture.model_type} graph; only BERT graphs read back"
        )
    if spec.heads:
        raise RecoverError(
            f"{directory}: its heads ({', '.join(spec.heads)}) are graphs of their own; read "
            "back a bundle of one graph"
        )
    if spec.precision not in RECOVERABLE:
        raise RecoverError(
            f"{directory} is {spec.precision}: its weights read back from {', '.join(RECOVERABLE)}"
        )
    if out.resolve() == directory.resolve():
        raise RecoverError(f"{out}: the checkpoint goes beside the bundle, not into it")
    path = directory / spec.model_file
    model_proto = onnx.load(str(path))
    graph = model_proto.graph
    _, table, _ = _take_word_table(graph, path)  # and the nodes that stored it
    _drop_unused_initializers(graph)  # its int8 rows and scales
    weights = read_weights(graph)
    weights["bert.embeddings.word_embeddings.weight"] = table

    arch_name = spec.source.architecture
    if arch_name not in HEADS:
        raise RecoverError(f"{directory}: architecture {arch_name!r} is not one of ours")
    config = _config(weights, model_proto.graph, spec)
    model = HEADS[arch_name](config.replace(architectures=(arch_name,)))
    expected = {k for k in model.state_dict() if k != "cls.predictions.decoder.weight"}
    missing = sorted(expected - weights.keys())
    if missing:
        raise RecoverError(f"{directory}: no weight for {missing[0]} ({len(missing)} in all)")
    extra = sorted(weights.keys() - expected)
    if extra:
        raise RecoverError(f"{directory}: a weight the model has no place for: {extra[0]}")
    state = {k: torch.from_numpy(weights[k]) for k in expected}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.eval()

    tokenizer = bundle_tokenizer(directory, spec)
    parity = torch_parity(
        model,
        list(spec.tasks),
        tokenizer,
        path,
        list(spec.inputs),
        list(spec.outputs),
        spec.max_seq_len,
        spec.pooling.model_dump() if spec.pooling else None,
    )
    save_model(model, out)
    tokenizer.save(out)
    if spec.source.init is not None:
        write_provenance(out, Provenance(**spec.source.init.model_dump()))
    report = {
        "bundle": str(directory),
        "model_sha256": sha256(path),
        "precision": spec.precision,
        "architecture": arch_name,
        "parity": parity,
    }
    (out / RECOVERED_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report
