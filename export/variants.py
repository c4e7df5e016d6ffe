"""Precision variants of an exported fp32 graph: fp16 (for GPUs), weights stored in fp16 with
fp32 arithmetic, dynamic int8 (for CPUs). Only onnx and ONNX Runtime, no torch: bench/gpu_check.py
converts graphs with these on a machine that has neither torch nor the model code's other needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


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

    # ONNX Runtime's quantiser logs its progress on the root logger: quiet it for this call
    # only (it once stayed at ERROR, and hid every later warning of the process).
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        quantize_dynamic(
            str(src),
            str(dst),
            weight_type=QuantType.QInt8,
            per_channel=True,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    finally:
        root.setLevel(level)


def int8_embeddings(src: Path, dst: Path) -> None:
    """The word-embedding table (the Gather on `input_ids`; with a tied MLM decoder, its weights
    too) stored as int8 with one scale a row: int8 rows, a float32 scale column, a Cast and a
    Mul, which ONNX Runtime folds back to the float32 table when it loads the graph. A quarter
    of the table's fp32 bytes (half of fp16's), the arithmetic unchanged. Not DequantizeLinear:
    measured on the MiniLM embedding bundle, ONNX Runtime's optimised graph holds this table as
    one fp32 initializer, but keeps a DequantizeLinear node and runs it on every call (4 x 32
    tokens, one thread: 41.7 ms against 34.7).
    Applies to the table in any form `_take_word_table` reads (fp32, fp16-stored, ...)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    name, table, _ = _take_word_table(graph, src)
    scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    rows = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
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
    _drop_unused_initializers(graph)  # the fp16-stored table the Cast read
    onnx.save(model, str(dst))


# QLoRA's 4-bit NormalFloat code (Dettmers et al. 2023): the 16 quantiles of a normal
# distribution scaled to [-1, 1], with an exact zero. Word-embedding rows are near normal, so these
# levels lose less than 16 even steps: on the shipped tables the relative error of a 32-wide block
# is 8.2% against 9.8% for even steps from the block's largest value.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
NF4_BLOCK = 32
NF4_CLIPS = 11  # scales tried per block, from half its largest |value| to all of it


def quantise_nf4(table: np.ndarray, block: int = NF4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """4-bit codes (uint8 in 0..15, the table's shape) and one float16 scale per `block` values
    of a row (shape (rows, cols / block, 1)): each block's scale is the one among `NF4_CLIPS`
    candidates whose levels come closest to it (least squared error), so one outlier does not
    stretch the levels over values that never reach them."""
    rows, cols = table.shape
    if cols % block:
        raise ValueError(f"a table {cols} wide does not split into blocks of {block}")
    levels = np.asarray(NF4_LEVELS, dtype=np.float32)
    midpoints = (levels[1:] + levels[:-1]) / 2
    values = table.astype(np.float32).reshape(rows, cols // block, block)
    largest = np.abs(values).max(axis=2, keepdims=True)
    codes = np.zeros(values.shape, dtype=np.uint8)
    scales = np.ones(largest.shape, dtype=np.float16)
    error = np.full(largest.shape, np.inf, dtype=np.float32)
    for ratio in np.linspace(0.5, 1.0, NF4_CLIPS):
        scale = (largest * ratio).astype(np.float16)
        scale[scale == 0] = 1.0
        scale32 = scale.astype(np.float32)
        # the nearest level: how many midpoints between levels lie below the value
        trial_codes = np.searchsorted(midpoints, values / scale32).astype(np.uint8)
        err = ((levels[trial_codes] * scale32 - values) ** 2).sum(axis=2, keepdims=True)
        better = err < error
        codes = np.where(better, trial_codes, codes)
        scales = np.where(better, scale, scales)
        error = np.minimum(err, error)
    return codes.reshape(rows, cols), scales


# ONNX Runtime's fused 4-bit gather (com.microsoft GatherBlockQuantized, bits 4, uint8 data):
# value = (code - the block's zero point) x the block's scale, 16 even steps from the block's
# (clipped) least to its largest value. With a zero point a block, the steps cover the values a
# block has, not a range symmetric about zero: relative error 7.9% on the students' tables,
# against 8.2% for NF4's levels and 8.8% for even steps about zero. One kernel gathers and
# unpacks the rows, where NF4 takes five nodes.
INT4_BLOCK = 32
INT4_CLIPS = 9  # ranges tried per block, from 0.6 of its least-to-largest range to all of it


def quantise_int4(
    table: np.ndarray, block: int = INT4_BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GatherBlockQuantized's codes (uint8 in 0..15, the table's shape), float32 scales and
    zero points (uint8 in 0..15), one of each per `block` values of a row (shape (rows,
    cols / block)). Each block's range is the one among `INT4_CLIPS` shrinkings of its
    least-to-largest values that reproduces it best (least squared error)."""
    rows, cols = table.shape
    if cols % block:
        raise ValueError(f"a table {cols} wide does not split into blocks of {block}")
    values = table.astype(np.float32).reshape(rows, cols // block, block)
    least, largest = values.min(axis=2, keepdims=True), values.max(axis=2, keepdims=True)
    shape = least.shape
    codes = np.zeros(values.shape, dtype=np.uint8)
    scales, zeros = np.ones(shape, np.float32), np.zeros(shape, np.uint8)
    error = np.full(shape, np.inf, dtype=np.float32)
    for ratio in np.linspace(0.6, 1.0, INT4_CLIPS):
        scale = ((largest - least) * np.float32(ratio / 15)).astype(np.float32)
        scale[scale == 0] = 1.0
        zero = np.clip(np.rint(-least * ratio / scale), 0, 15)
        trial = np.clip(np.rint(values / scale) + zero, 0, 15)
        err = (((trial - zero) * scale - values) ** 2).sum(axis=2, keepdims=True)
        better = err < error
        codes = np.where(better, trial, codes).astype(np.uint8)
        scales = np.where(better, scale, scales)
        zeros = np.where(better, zero, zeros).astype(np.uint8)
        error = np.minimum(err, error)
    return codes.reshape(rows, cols), scales[..., 0], zeros[..., 0]


def dequantise_int4(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """What GatherBlockQuantized computes from `quantise_int4`'s output: the float32 table."""
    rows, cols = codes.shape
    steps = codes.reshape(rows, scales.shape[1], -1).astype(np.float32) - zeros[..., None]
    return (steps * scales[..., None]).reshape(rows, cols)


def nf4_byte_pairs() -> np.ndarray:
    """(256, 2) float32: the levels of the two codes a byte holds, the low nibble first."""
    levels = np.asarray(NF4_LEVELS, dtype=np.float32)
    byte = np.arange(256)
    return np.stack([levels[byte & 15], levels[byte >> 4]], axis=1)


def pack_4bit(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes to a byte, the first (an even column) in the low nibble: (rows, cols) ->
    (rows, cols / 2) uint8. NF4 codes and GatherBlockQuantized's codes and zero points alike."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def dequantise_nf4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What the graph computes from `quantise_nf4`'s output: the float32 table."""
    rows, cols = codes.shape
    levels = np.asarray(NF4_LEVELS, dtype=np.float32)[codes].reshape(rows, scales.shape[1], -1)
    return (levels * scales.astype(np.float32)).reshape(rows, cols)


def _take_word_table(graph: Any, src: Path) -> tuple[str, np.ndarray, Any]:
    """Take the word-embedding table out of a graph in any of our precisions: returns the name
    of the float32 tensor the Gather on `input_ids` reads (and a tied decoder with it), for the
    caller to produce again; its value; and that Gather. The nodes and the initializer that
    held the table are removed (initializers they read go with `_drop_unused_initializers`).
    A dynamic int8 graph gathers uint8 rows and dequantises them after the Gather: that pair
    becomes a Gather on a float32 table."""
    from onnx import TensorProto, numpy_helper

    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    if len(gathers) != 1:
        raise ValueError(f"{src}: expected one Gather on input_ids, found {len(gathers)}")
    gather = gathers[0]
    name = gather.input[0]
    array = numpy_helper.to_array
    made = producers.get(name)
    if name in inits and inits[name].data_type == TensorProto.UINT8:
        after = [n for n in graph.node if gather.output[0] in n.input]
        if len(after) != 1 or after[0].op_type != "DequantizeLinear":
            raise ValueError(f"{src}: uint8 word embeddings without their DequantizeLinear")
        dq = after[0]
        scale, zero = array(inits[dq.input[1]]), array(inits[dq.input[2]])
        table = (array(inits[name]).astype(np.float32) - zero.astype(np.float32)) * scale
        float_name = name.removesuffix("_quantized")
        if float_name in inits or float_name in producers:
            float_name += "_float"
        gather.input[0], gather.output[0] = float_name, dq.output[0]
        graph.node.remove(dq)
        return float_name, table, gather
    if name in inits:  # fp32
        table = array(inits[name]).astype(np.float32)
        graph.initializer.remove(inits[name])
        return name, table, gather
    if made is not None and made.op_type == "Cast" and made.input[0] in inits:  # fp16-stored
        graph.node.remove(made)
        return name, array(inits[made.input[0]]).astype(np.float32), gather
    if made is not None and made.op_type == "Mul":  # int8 rows x scale column
        cast = producers.get(made.input[0])
        if cast is not None and cast.op_type == "Cast" and cast.input[0] in inits:
            rows = array(inits[cast.input[0]]).astype(np.float32)
            graph.node.remove(made)
            graph.node.remove(cast)
            return name, rows * array(inits[made.input[1]]), gather
    raise ValueError(f"{src}: the word-embedding table {name!r} is not one this tool knows")


def nf4_embeddings(src: Path, dst: Path) -> None:
    """The word-embedding table stored in 4 bits a value (`quantise_nf4`: NF4 codes, two to a
    byte, and a float16 scale per 32 values of a row): a ninth of the table's fp32 bytes (55% of
    int8 rows). Applies to every precision here (fp32, fp16-stored, int8 rows, dynamic int8).

    Where only the Gather on `input_ids` reads the table, the graph gathers packed rows and
    their scales and unpacks just those (a Gather of each byte's two levels, a Mul by the
    scales): the table stays 4-bit in memory too, and each call unpacks batch x length x hidden
    values (6% of a 2 x 192 student's time, 1-2% of a MiniLM's, in batch-by-batch A/Bs as a
    worker runs them: `bertserve bench graph-ab`). Where a tied MLM decoder reads it as well,
    the same nodes unpack the whole table from constants, which ONNX Runtime folds back to the
    float32 table when it loads the graph.
    Either way the values are the same float32 products, so the answers are too."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    name, table, gather = _take_word_table(graph, src)
    readers = [n for n in graph.node if name in n.input]
    per_row = readers == [gather]
    codes, scales = quantise_nf4(table)
    rows, cols = codes.shape
    n = f"{name}_nf4"
    lead = [0, 0] if per_row else [rows]  # Reshape's 0: batch and length as they come
    constants = {
        n: pack_4bit(codes),  # two codes a byte, the even column in the low nibble
        f"{n}_scale": scales,
        f"{n}_pairs": nf4_byte_pairs(),
        f"{n}_blocks": np.asarray([*lead, cols // NF4_BLOCK, NF4_BLOCK], dtype=np.int64),
        f"{n}_shape": np.asarray([*lead, cols], dtype=np.int64),
    }
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())

    def node(op: str, inputs: list[str], output: str, **attrs: Any) -> Any:
        return helper.make_node(op, inputs, [output], name=output + "_node", **attrs)

    packed, scale, out = n, f"{n}_scale", name
    nodes: list[Any] = []
    if per_row:
        ids, out = gather.input[1], gather.output[0]
        graph.node.remove(gather)
        packed, scale = f"{n}_rows", f"{n}_row_scales"
        nodes += [node("Gather", [n, ids], packed), node("Gather", [f"{n}_scale", ids], scale)]
    nodes += [  # a byte -> the levels of its two codes: one Gather on 256 pairs
        node("Cast", [packed], f"{n}_bytes", to=TensorProto.INT32),
        node("Gather", [f"{n}_pairs", f"{n}_bytes"], f"{n}_levels_at"),
        node("Reshape", [f"{n}_levels_at", f"{n}_blocks"], f"{n}_blocked"),
        node("Cast", [scale], f"{n}_scale32", to=TensorProto.FLOAT),
        node("Mul", [f"{n}_blocked", f"{n}_scale32"], f"{n}_values"),
        node("Reshape", [f"{n}_values", f"{n}_shape"], out),
    ]
    for made in reversed(nodes):
        graph.node.insert(0, made)
    _drop_unused_initializers(graph)
    onnx.save(model, str(dst))


def int4_embeddings(src: Path, dst: Path) -> None:
    """The word-embedding table in 4 bits a value for ONNX Runtime's fused gather
    (`quantise_int4`; com.microsoft GatherBlockQuantized, which has CPU and CUDA kernels): the
    Gather on `input_ids` becomes one node that reads packed rows and unpacks only those. With
    a float32 scale and a 4-bit zero point per 32 values, 5.1 bits a value: a sixth of the
    fp32 table's bytes. For a table only that Gather reads: a tied MLM decoder needs the whole
    table (`nf4_embeddings` serves it). Applies to every precision here, as `nf4_embeddings`
    does."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    name, table, gather = _take_word_table(graph, src)
    if [n for n in graph.node if name in n.input] != [gather]:
        raise ValueError(
            f"{src}: more than the input Gather reads the word-embedding table (a tied "
            "decoder); the fused 4-bit gather serves rows only: use *-nf4-embeddings"
        )
    codes, scales, zeros = quantise_int4(table)
    if zeros.shape[1] % 2:  # packed two to a byte like the codes: an odd count gets a pad
        zeros = np.pad(zeros, ((0, 0), (0, 1)))
    n = f"{name}_int4"
    packed = {n: pack_4bit(codes), f"{n}_scale": scales, f"{n}_zero": pack_4bit(zeros)}
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in packed.items())
    fused = helper.make_node(
        "GatherBlockQuantized",
        [n, gather.input[1], f"{n}_scale", f"{n}_zero"],
        [gather.output[0]],
        name=f"{n}_gather",
        domain="com.microsoft",
        bits=4,
        block_size=INT4_BLOCK,
        gather_axis=0,
        quantize_axis=1,
    )
    graph.node.insert(list(graph.node).index(gather), fused)
    graph.node.remove(gather)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _drop_unused_initializers(graph)
    onnx.save(model, str(dst))


def _drop_unused_initializers(graph: Any) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)


Convert = Callable[[Path, Path], None]  # (src, dst): a graph rewritten at another precision


def _then_table(weights: Convert, table: Convert) -> Convert:
    """A conversion: `weights` (`to_int8`, `to_fp16_weights`) on the whole graph, then `table`
    (`int8_embeddings`, `nf4_embeddings`, `int4_embeddings`) on its word-embedding table."""

    def convert(src: Path, dst: Path) -> None:
        weights(src, dst)
        table(dst, dst)

    return convert


# precision -> the conversion of an fp32 graph to it
CONVERT = {
    "fp16": to_fp16,
    "fp16-weights": to_fp16_weights,
    # fp16-weights-int8-embeddings: for the models whose full int8 quantisation costs accuracy
    "fp16-weights-int8-embeddings": _then_table(to_fp16_weights, int8_embeddings),
    "fp16-weights-nf4-embeddings": _then_table(to_fp16_weights, nf4_embeddings),
    "fp16-weights-int4-embeddings": _then_table(to_fp16_weights, int4_embeddings),
    "int8": to_int8,
    "int8-nf4-embeddings": _then_table(to_int8, nf4_embeddings),
    "int8-int4-embeddings": _then_table(to_int8, int4_embeddings),
}
# what an already converted graph may become without its fp32 original (export convert)
RECONVERT = {
    ("fp16-weights", "fp16-weights-int8-embeddings"): int8_embeddings,
    ("fp16-weights", "fp16-weights-nf4-embeddings"): nf4_embeddings,
    ("fp16-weights-int8-embeddings", "fp16-weights-nf4-embeddings"): nf4_embeddings,
    ("fp16-weights", "fp16-weights-int4-embeddings"): int4_embeddings,
    ("fp16-weights-int8-embeddings", "fp16-weights-int4-embeddings"): int4_embeddings,
    ("int8", "int8-nf4-embeddings"): nf4_embeddings,
    ("int8", "int8-int4-embeddings"): int4_embeddings,
}
# precision -> the conversion of an fp32 head graph (bundle.json "heads": no word-embedding
# Gather of its own; a sparse head's tied decoder is stored as the precision stores weights)
HEAD_CONVERT: dict[str, Convert] = {
    precision: to_fp16
    if precision == "fp16"
    else to_int8
    if precision.startswith("int8")
    else to_fp16_weights
    for precision in CONVERT
}
