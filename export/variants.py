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
