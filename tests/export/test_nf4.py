"""NF4 word-embedding tables: the 4-bit codes and scales, the graph that unpacks them (checked
value for value against numpy in every stored form a table can have), ONNX Runtime folding that
graph away, and whole bundles built and converted at the two `*-nf4-embeddings` precisions."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bertserve.export.__main__ import main
from bertserve.export.bundle import build_bundle, verify
from bertserve.export.parity import onnx_outputs
from bertserve.export.variants import (
    NF4_BLOCK,
    NF4_LEVELS,
    dequantise_nf4,
    nf4_embeddings,
    quantise_nf4,
)
from bertserve.runtime.bundle import load_bundle_spec
from tests.export.test_export import eval_tsv

VOCAB, HIDDEN = 500, 96  # three blocks a row


def test_codes_and_scales_keep_a_normal_table_within_a_tenth():
    rng = np.random.default_rng(0)
    table = rng.normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32)
    table[3] = 0.0  # a padding row stays exactly zero
    table[7, 5] = 1.0  # one outlier does not stretch its block's levels over the others
    codes, scales = quantise_nf4(table)
    assert codes.shape == table.shape and codes.dtype == np.uint8 and codes.max() <= 15
    assert scales.shape == (VOCAB, HIDDEN // NF4_BLOCK, 1) and scales.dtype == np.float16
    back = dequantise_nf4(codes, scales)
    assert np.all(back[3] == 0.0)
    normal = np.delete(np.arange(VOCAB), [3, 7])
    error = np.linalg.norm(back[normal] - table[normal]) / np.linalg.norm(table[normal])
    assert error < 0.10
    # values already on the levels of their block's scale come back exactly
    codes = rng.integers(0, 16, (VOCAB, HIDDEN))
    codes[:, ::NF4_BLOCK] = 0  # the level -1: each block's largest |value| is its scale
    on_levels = np.asarray(NF4_LEVELS, np.float32)[codes] * np.float32(0.5)
    assert np.array_equal(dequantise_nf4(*quantise_nf4(on_levels)), on_levels)


def test_a_table_that_does_not_split_into_blocks_is_refused():
    with pytest.raises(ValueError, match="48 wide does not split into blocks of 32"):
        quantise_nf4(np.zeros((4, 48), np.float32))


def _gather_graph(table: np.ndarray, form: str, path, tied: bool):
    """input_ids -> Gather on the word table, stored as each precision here stores it; `tied`:
    the whole table is an output too, as a tied MLM decoder reads it."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    out = [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["b", "s", HIDDEN])]
    name = "word_embeddings.weight"
    nodes, inits = [], []
    if form == "fp32":
        inits.append(numpy_helper.from_array(table, name))
        stored = table
    elif form == "fp16-weights":
        half = table.astype(np.float16)
        inits.append(numpy_helper.from_array(half, name + "_fp16"))
        nodes.append(helper.make_node("Cast", [name + "_fp16"], [name], to=TensorProto.FLOAT))
        stored = half.astype(np.float32)
    elif form == "int8-rows":
        scale = (np.abs(table).max(axis=1, keepdims=True) / 127).astype(np.float32)
        rows = np.rint(table / scale).astype(np.int8)
        inits += [numpy_helper.from_array(rows, "r"), numpy_helper.from_array(scale, "s")]
        nodes += [
            helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["rf", "s"], [name]),
        ]
        stored = rows.astype(np.float32) * scale
    else:  # dynamic int8: uint8 rows gathered, then dequantised
        scale, zero = np.float32(np.ptp(table) / 255), np.uint8(128)
        q = np.clip(np.rint(table / scale) + 128, 0, 255).astype(np.uint8)
        inits += [
            numpy_helper.from_array(q, name + "_quantized"),
            numpy_helper.from_array(np.asarray(scale), "scale"),
            numpy_helper.from_array(np.asarray(zero), "zero"),
        ]
        nodes += [
            helper.make_node("Gather", [name + "_quantized", "input_ids"], ["g_q"]),
            helper.make_node("DequantizeLinear", ["g_q", "scale", "zero"], ["embedded"]),
        ]
        stored = (q.astype(np.float32) - 128) * scale
    if form != "int8":
        nodes.append(helper.make_node("Gather", [name, "input_ids"], ["embedded"]))
    if tied:
        nodes.append(helper.make_node("Identity", [name], ["table"]))
        out.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, [VOCAB, HIDDEN]))
    graph = helper.make_graph(nodes, "g", [ids], out, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return stored


def optimised_graph(path, tmp_path):
    """The graph as ONNX Runtime runs it, after its optimisations at load."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath).graph


FORMS = [(f, False) for f in ("fp32", "fp16-weights", "int8-rows", "int8")] + [
    (f, True)
    for f in ("fp32", "fp16-weights", "int8-rows")  # dynamic int8 has no float table
]


@pytest.mark.parametrize(("form", "tied"), FORMS)
def test_the_graph_unpacks_exactly_what_numpy_quantised(form, tied, tmp_path):

    table = np.random.default_rng(1).normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32)
    src, dst = tmp_path / "src.onnx", tmp_path / "nf4.onnx"
    stored = _gather_graph(table, form, src, tied)
    nf4_embeddings(src, dst)
    ids = np.array([[0, 1, 2, 499], [7, 7, 30, 11]], dtype=np.int64)
    got = onnx_outputs(dst, {"input_ids": ids})
    want = dequantise_nf4(*quantise_nf4(stored))
    np.testing.assert_array_equal(got["embedded"], want[ids])
    if tied:
        np.testing.assert_array_equal(got["table"], want)

    model = onnx.load(str(dst))
    packed = [i for i in model.graph.initializer if i.data_type == TensorProto.UINT8 and i.dims]
    assert [list(i.dims) for i in packed] == [[VOCAB, HIDDEN // 2]]  # the old table is gone
    # 4 bits a value and a 16-bit scale per 32: 4.5 bits against 32, 16 or 8 (+ graph overhead)
    bound = {"fp32": 0.2, "fp16-weights": 0.35, "int8-rows": 0.65, "int8": 0.65}[form]
    assert dst.stat().st_size < bound * src.stat().st_size

    # As ONNX Runtime runs it: gathered alone, the table stays packed and only the gathered rows
    # are unpacked; read whole, it is unpacked once, at load, into one float32 table.
    optimised = optimised_graph(dst, tmp_path)
    float_tables, packed_tables = (
        [i for i in optimised.initializer if list(i.dims) == dims and i.data_type == kind]
        for dims, kind in (
            ([VOCAB, HIDDEN], TensorProto.FLOAT),
            ([VOCAB, HIDDEN // 2], TensorProto.UINT8),
        )
    )
    if tied:
        assert float_tables and not packed_tables
    else:
        assert packed_tables and not float_tables


def test_int8_bundle_with_nf4_table_is_smaller_and_keeps_its_answers(checkpoints, tmp_path):
    data = eval_tsv(tmp_path / "dev.tsv")
    ckpt = checkpoints["BertForSequenceClassification"]
    for precision in ("int8", "int8-nf4-embeddings"):
        spec = build_bundle(ckpt, ["classify"], tmp_path / precision, precision, eval_data=data)
    assert spec.precision == "int8-nf4-embeddings"
    assert verify(tmp_path / precision)["parity"]["top1_agreement"] >= 0.95
    tables = {  # (the tiny table is 3 kB: the unpacking nodes outweigh what it saves here)
        p: sorted(
            list(i.dims)
            for i in onnx.load(str(tmp_path / p / "model.onnx")).graph.initializer
            if i.dims[:1] == [99]
        )
        for p in ("int8", precision)
    }
    assert tables == {"int8": [[99, 32]], precision: [[99, 1, 1], [99, 16]]}


def test_tied_decoder_reads_the_one_nf4_table(checkpoints, tmp_path):
    """fill-mask: the MLM decoder is the word-embedding table; it is stored once, in 4 bits, and
    the gate measures what that does to the decoder's logits (the tiny model's top-1 words
    move too much to pass it: forced here, refused without --force)."""
    build = {
        "checkpoint": checkpoints["BertForPreTraining"],
        "tasks": ["fill-mask"],
        "precision": "fp16-weights-nf4-embeddings",
        "eval_data": eval_tsv(tmp_path / "dev.tsv"),
    }
    with pytest.raises(ValueError, match="top-1 agreement with fp32 is 0.9"):
        build_bundle(out=tmp_path / "refused", **build)
    spec = build_bundle(out=tmp_path / "b", force=True, **build)
    assert spec.precision == "fp16-weights-nf4-embeddings"
    assert "top-1 agreement" in spec.variant_accuracy["forced"]
    graph = onnx.load(str(tmp_path / "b" / "model.onnx")).graph
    vocab_sized = [i for i in graph.initializer if i.dims[:1] == [99] and len(i.dims) >= 2]
    assert sorted((list(i.dims), i.data_type) for i in vocab_sized) == [
        ([99, 1, 1], TensorProto.FLOAT16),  # one scale per 32 values: one block a row here
        ([99, 16], TensorProto.UINT8),
    ]


@pytest.mark.parametrize("precision", ["int8-nf4-embeddings", "int8-int4-embeddings"])
def test_convert_moves_an_int8_bundle_to_a_4bit_table(precision, checkpoints, tmp_path):
    """Both 4-bit tables (NF4 here, ORT's fused gather in test_int4.py) from an int8 bundle."""
    data = eval_tsv(tmp_path / "dev.tsv")
    bundle = tmp_path / "c"
    build_bundle(
        checkpoints["BertForSequenceClassification"], ["classify"], bundle, "int8", eval_data=data
    )
    before = load_bundle_spec(bundle)
    args = ["convert", str(bundle), "--precision", precision, "--eval-data", str(data)]
    assert main(args) == 0
    after = load_bundle_spec(bundle)
    assert after.precision == precision
    assert after.variant_accuracy["reference"] == "int8"
    assert after.variant_accuracy["converted_from"]["sha256"] == before.model_sha256
    assert verify(bundle)["precision"] == precision
