"""4-bit word-embedding tables for ONNX Runtime's fused gather (GatherBlockQuantized): the codes,
scales and zero points, the graph checked value for value against numpy in every stored form a
table can have, the tied decoder it cannot serve, and bundles built at the two
`*-int4-embeddings` precisions (converting one: test_nf4.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from bertserve.export.bundle import build_bundle, verify
from bertserve.export.parity import onnx_outputs
from bertserve.export.variants import INT4_BLOCK, dequantise_int4, int4_embeddings, quantise_int4
from tests.export.test_export import eval_tsv
from tests.export.test_nf4 import FORMS, HIDDEN, VOCAB, _gather_graph, optimised_graph


def test_codes_scales_and_zero_points_keep_a_normal_table_within_a_tenth():
    rng = np.random.default_rng(0)
    table = rng.normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32)
    table[3] = 0.0  # a padding row stays exactly zero
    table[7, 5] = 1.0  # one outlier: its block's range is clipped where that costs less
    codes, scales, zeros = quantise_int4(table)
    blocks = (VOCAB, HIDDEN // INT4_BLOCK)
    assert codes.shape == table.shape and codes.dtype == np.uint8 and codes.max() <= 15
    assert scales.shape == blocks and scales.dtype == np.float32
    assert zeros.shape == blocks and zeros.dtype == np.uint8 and zeros.max() <= 15
    back = dequantise_int4(codes, scales, zeros)
    assert np.all(back[3] == 0.0)
    normal = np.delete(np.arange(VOCAB), [3, 7])
    error = np.linalg.norm(back[normal] - table[normal]) / np.linalg.norm(table[normal])
    assert error < 0.09
    # A block whose values sit on 16 even steps (its least on code 0, its largest on 15) comes
    # back exactly, wherever its zero lies: the zero point follows the values, not 0.
    grid = rng.integers(0, 16, (VOCAB, HIDDEN))
    grid[:, ::INT4_BLOCK], grid[:, 1::INT4_BLOCK] = 0, 15
    zero = rng.integers(0, 16, (VOCAB, HIDDEN // INT4_BLOCK, 1))
    on_steps = ((grid.reshape(VOCAB, -1, INT4_BLOCK) - zero) * 0.5).astype(np.float32)
    on_steps = on_steps.reshape(VOCAB, HIDDEN)
    np.testing.assert_allclose(dequantise_int4(*quantise_int4(on_steps)), on_steps, atol=1e-6)


def test_a_table_that_does_not_split_into_blocks_is_refused():
    with pytest.raises(ValueError, match="48 wide does not split into blocks of 32"):
        quantise_int4(np.zeros((4, 48), np.float32))


@pytest.mark.parametrize("form", [form for form, tied in FORMS if not tied])
def test_the_fused_gather_returns_exactly_what_numpy_quantised(form, tmp_path):

    table = np.random.default_rng(1).normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32)
    src, dst = tmp_path / "src.onnx", tmp_path / "int4.onnx"
    stored = _gather_graph(table, form, src, tied=False)
    int4_embeddings(src, dst)
    ids = np.array([[0, 1, 2, 499], [7, 7, 30, 11]], dtype=np.int64)
    got = onnx_outputs(dst, {"input_ids": ids})
    want = dequantise_int4(*quantise_int4(stored))
    np.testing.assert_allclose(got["embedded"], want[ids], rtol=0, atol=1e-7)

    model = onnx.load(str(dst))
    assert [n.op_type for n in model.graph.node] == ["GatherBlockQuantized"]
    stored_as = sorted((list(i.dims), i.data_type) for i in model.graph.initializer)
    assert stored_as == [  # the old table is gone; three blocks a row: zero points padded to 4
        ([VOCAB, 2], TensorProto.UINT8),
        ([VOCAB, 3], TensorProto.FLOAT),
        ([VOCAB, HIDDEN // 2], TensorProto.UINT8),
    ]
    # 4 bits a value, a 32-bit scale and a 4-bit zero point per 32: 5.1 bits against 32, 16, 8
    bound = {"fp32": 0.2, "fp16-weights": 0.4, "int8-rows": 0.75, "int8": 0.75}[form]
    assert dst.stat().st_size < bound * src.stat().st_size

    # ONNX Runtime keeps the table packed: no float32 table appears when it optimises the graph
    optimised = optimised_graph(dst, tmp_path)
    assert not [i for i in optimised.initializer if list(i.dims) == [VOCAB, HIDDEN]]


def test_a_table_a_tied_decoder_reads_is_refused(tmp_path):
    table = np.random.default_rng(2).normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32)
    _gather_graph(table, "fp32", tmp_path / "tied.onnx", tied=True)
    with pytest.raises(ValueError, match="tied decoder.*use \\*-nf4-embeddings"):
        int4_embeddings(tmp_path / "tied.onnx", tmp_path / "out.onnx")


def test_bundles_with_int4_tables_keep_their_answers(checkpoints, tmp_path):
    data = eval_tsv(tmp_path / "dev.tsv")
    ckpt = checkpoints["BertForSequenceClassification"]
    for precision in ("int8-int4-embeddings", "fp16-weights-int4-embeddings"):
        spec = build_bundle(ckpt, ["classify"], tmp_path / precision, precision, eval_data=data)
        assert spec.precision == precision
        assert verify(tmp_path / precision)["parity"]["top1_agreement"] >= 0.95
        nodes = onnx.load(str(tmp_path / precision / "model.onnx")).graph.node
        assert [n.input[1] for n in nodes if n.op_type == "GatherBlockQuantized"] == ["input_ids"]
