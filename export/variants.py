"""Precision variants of an exported fp32 graph: fp16 (for GPUs), weights stored in fp16 with
fp32 arithmetic, dynamic int8 (for CPUs). Only onnx and ONNX Runtime, no torch: bench/gpu_check.py
converts graphs with these on a machine that has neither torch nor the model code's other needs.
"""

from __future__ import annotations

import logging
from pathlib import Path


def to_fp16(src: Path, dst: Path) -> None:
    """Float16 weights and compute for the CUDA execution provider; inputs and outputs keep their
    types (int64 in, float32 out) so the service feeds every precision the same way."""
    import onnx
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(onnx.load(str(src)))
    model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(str(dst))


def to_fp16_weights(src: Path, dst: Path, min_size: int = 4096) -> None:
    """Weights stored in float16, arithmetic in float32: each large float initializer becomes a
    float16 one plus a Cast, which ONNX Runtime folds back to float32 when it loads the graph.
    Half the file, the speed and (nearly) the answers of fp32, on any provider."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    casts = []
    for init in list(graph.initializer):
        if init.data_type != TensorProto.FLOAT or int(np.prod(init.dims)) < min_size:
            continue
        half = numpy_helper.from_array(
            numpy_helper.to_array(init).astype(np.float16), f"{init.name}_fp16"
        )
        graph.initializer.remove(init)
        graph.initializer.append(half)
        casts.append(
            helper.make_node(
                "Cast", [half.name], [init.name], to=TensorProto.FLOAT, name=f"{init.name}_cast"
            )
        )
    for node in reversed(casts):
        graph.node.insert(0, node)
    onnx.save(model, str(dst))


def to_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantisation of the weights (activations quantised at run time): for CPU.
    Per output channel: per tensor cost the MiniLM SST-2 model 1.5 points of dev accuracy
    (89.7 -> 88.2), per channel none (89.8), at the same size."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    quantize_dynamic(
        str(src),
        str(dst),
        weight_type=QuantType.QInt8,
        per_channel=True,
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def int8_embeddings(src: Path, dst: Path) -> None:
    """The word-embedding table (the Gather on `input_ids`; with a tied MLM decoder, its weights
    too) stored as int8 with one scale a row: int8 rows, a float32 scale column, a Cast and a
    Mul, which ONNX Runtime folds back to the float32 table when it loads the graph. A quarter
    of the table's fp32 bytes (half of fp16's), the arithmetic unchanged. Not DequantizeLinear:
    measured on the MiniLM embedding bundle, ONNX Runtime's optimised graph holds this table as
    one fp32 initializer, but keeps a DequantizeLinear node and runs it on every call (4 x 32
    tokens, one thread: 41.7 ms against 34.7).
    Applies to an fp32 graph or one with fp16-stored weights (the table behind a Cast)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    if len(gathers) != 1:
        raise ValueError(f"{src}: expected one Gather on input_ids, found {len(gathers)}")
    name = gathers[0].input[0]
    stored, cast = inits.get(name), None
    if stored is None and name in producers and producers[name].op_type == "Cast":
        cast = producers[name]
        stored = inits.get(cast.input[0])
    if stored is None:
        raise ValueError(f"{src}: the word-embedding table {name!r} is not an initializer")
    table = numpy_helper.to_array(stored).astype(np.float32)
    scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    rows = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
    graph.initializer.remove(stored)
    if cast is not None:
        graph.node.remove(cast)
    graph.initializer.extend(
        [
            numpy_helper.from_array(rows, f"{name}_int8"),
            numpy_helper.from_array(scale.astype(np.float32), f"{name}_scale"),
        ]
    )
    nodes = [
        helper.make_node(
            "Cast", [f"{name}_int8"], [f"{name}_rows"], to=TensorProto.FLOAT, name=f"{name}_cast"
        ),
        helper.make_node("Mul", [f"{name}_rows", f"{name}_scale"], [name], name=f"{name}_dequant"),
    ]
    for node in reversed(nodes):
        graph.node.insert(0, node)
    onnx.save(model, str(dst))


def to_fp16_weights_int8_embeddings(src: Path, dst: Path) -> None:
    """fp16-stored weights, and the word-embedding table in int8 rows (above): for the models
    whose full int8 quantisation costs accuracy. fp32 arithmetic throughout."""
    to_fp16_weights(src, dst)
    int8_embeddings(dst, dst)


# precision -> the conversion of an fp32 graph to it
CONVERT = {
    "fp16": to_fp16,
    "fp16-weights": to_fp16_weights,
    "fp16-weights-int8-embeddings": to_fp16_weights_int8_embeddings,
    "int8": to_int8,
}
# what an already converted graph may become without its fp32 original (export convert)
RECONVERT = {("fp16-weights", "fp16-weights-int8-embeddings"): int8_embeddings}
