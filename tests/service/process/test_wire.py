"""The engine process's wire format (service.process.wire): arrays round-trip exactly, no copy,
and a message out of format is refused with a reason, never loaded."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest

from bertserve.service.process.wire import WireError, pack, unpack


def test_arrays_and_fields_round_trip_exactly_as_read_only_views():
    arrays = {
        "input_ids": np.arange(12, dtype=np.int64).reshape(3, 4),
        "mask_positions": np.zeros((3, 0), np.int64),  # /nsp's empty mask axis
        "logits": np.linspace(-1, 1, 30, dtype=np.float32).reshape(3, 2, 5)[:, ::2],  # strided
        "half": np.array([[1.5, -2.25]], np.float16),
    }
    message = pack("ok", arrays, provider="CPUExecutionProvider")
    header, out = unpack(message)
    assert header == {"kind": "ok", "provider": "CPUExecutionProvider"}
    assert list(out) == list(arrays)
    for name, value in arrays.items():
        assert out[name].dtype == value.dtype and out[name].shape == value.shape, name
        np.testing.assert_array_equal(out[name], value, err_msg=name)
        assert not out[name].flags.writeable  # a view of the message: no copy
    header_length = int.from_bytes(message[:4], "big")
    assert len(message) - 4 - header_length == sum(v.nbytes for v in arrays.values())


def test_empty_arrays_travel_with_their_shapes():
    """/nsp batches send mask_positions of width 0 and get MLM logits of width 0 back: the
    engine process must see (rows, 0), not a flattened or dropped array."""
    arrays = {
        "mask_positions": np.zeros((3, 5), np.int64)[:, :0],
        "mlm_logits": np.zeros((3, 0, 7), np.float32),
        "input_ids": np.arange(6, dtype=np.int64).reshape(3, 2),
    }
    _, back = unpack(pack("batch", arrays))
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in arrays.items()}
    assert back["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5]]


def test_pack_refuses_a_dtype_no_model_takes():
    with pytest.raises(WireError, match="dtype object does not travel"):
        pack("run", {"input_ids": np.array([["a"]], dtype=object)})


def frame(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + data


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"\x00\x01", "has no header length"),
        (b"\x00\x00\x01\x00{}", "claims 256 bytes"),
        (struct.pack(">I", 3) + b"\xff\xfe{", "not JSON"),
        (frame(["run"]), "an object with a 'kind'"),
        (frame({"arrays": []}), "an object with a 'kind'"),
        (frame({"kind": "run", "arrays": {}}), "'arrays' is not a list"),
        (frame({"kind": "run", "arrays": [["x", "int64"]]}), r"\[name, dtype, shape\]"),
        (frame({"kind": "run", "arrays": [["x", "object", [1]]]}, b"\0" * 8), "dtype 'object'"),
        (frame({"kind": "run", "arrays": [["x", "int64", [-1]]]}), "dimensions >= 0"),
        (frame({"kind": "run", "arrays": [["x", "int64", [True]]]}), "dimensions >= 0"),
        (frame({"kind": "run", "arrays": [["x", "int64", [2]]]}, b"\0" * 15), "16 bytes of data"),
        (frame({"kind": "run", "arrays": [["x", "int64", [2**62, 2**62]]]}), "bytes of data"),
        (frame({"kind": "run", "arrays": [["x", "int64", [1]]]}, b"\0" * 9), "1 bytes after"),
    ],
)
def test_a_message_out_of_format_is_refused_with_its_reason(message, reason):
    with pytest.raises(WireError, match=reason):
        unpack(message)


class Loaded(Exception):
    pass


class Payload:
    def __reduce__(self):
        return (Loaded, ("unpickled",))


def test_a_pickle_is_refused_not_loaded():
    with pytest.raises(WireError):
        unpack(pickle.dumps(Payload()))
