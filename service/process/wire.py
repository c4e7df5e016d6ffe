"""The engine process's wire format: a JSON header and raw arrays, never a pickle.

The workers (service/process/engine_client.py) and the engine process
(service/process/engine_server.py)
exchange messages over a Unix socket as
`multiprocessing.connection` byte messages (`send_bytes`/`recv_bytes`, which frame them with a
length). One message is:

    4 bytes    N, the header's length (unsigned, big-endian)
    N bytes    the header, UTF-8 JSON: an object with a "kind" and the message's fields, and
               "arrays": [[name, dtype, [dim, ...]], ...]
    the rest   each array's bytes, C order, little-endian, one after another in the header's order

The reader checks every field before it trusts it: an unknown dtype, a negative dimension, or
array bytes that do not add up to exactly what is left of the message is a `WireError`, and the
connection that sent it is closed. Nothing in a message can make the reader run code (design.md:
no code path loads a pickle), and the format is simple enough for an engine in another language.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

# What the models take and give: ids and masks (int64), logits and embeddings (float32, or
# float16 from an fp16 graph). Anything else on the wire is a mistake.
DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ("int64", "float32", "float16")}
_LENGTH = struct.Struct(">I")


class WireError(ValueError):
    """A message that does not follow the format."""


def pack(kind: str, arrays: Mapping[str, np.ndarray] | None = None, **fields: Any) -> bytes:
    """One message: `kind`, JSON-able `fields`, and `arrays` (names to arrays of DTYPES)."""
    specs, buffers = [], []
    for name, value in (arrays or {}).items():
        dtype = DTYPES.get(value.dtype.name)
        if dtype is None:
            raise WireError(f"{name}: dtype {value.dtype} does not travel (only {sorted(DTYPES)})")
        specs.append([name, value.dtype.name, list(value.shape)])
        buffers.append(np.ascontiguousarray(value, dtype=dtype).data)
    header = json.dumps({"kind": kind, **fields, "arrays": specs}).encode()
    return b"".join([_LENGTH.pack(len(header)), header, *buffers])


def unpack(message: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header's fields (with "kind") and the arrays of one message. The arrays are read-only
    views of `message`: no copy."""
    view = memoryview(message)
    if len(view) < _LENGTH.size:
        raise WireError(f"a message of {len(view)} bytes has no header length")
    (length,) = _LENGTH.unpack_from(view)
    start = _LENGTH.size + length
    if start > len(view):
        raise WireError(f"the header claims {length} bytes; the message has {len(view)}")
    try:
        header = json.loads(bytes(view[_LENGTH.size : start]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"the header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise WireError("the header is not an object with a 'kind'")
    specs = header.pop("arrays", [])
    if not isinstance(specs, list):
        raise WireError("'arrays' is not a list")
    arrays, offset = {}, start
    for spec in specs:
        name, dtype, shape = _check_spec(spec)
        size = dtype.itemsize * math.prod(shape)  # exact: no overflow
        if offset + size > len(view):
            raise WireError(f"{name}: {size} bytes of data, {len(view) - offset} left")
        flat = np.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=offset)
        arrays[name] = flat.reshape(shape)
        offset += size
    if offset != len(view):
        raise WireError(f"{len(view) - offset} bytes after the last array")
    return header, arrays


def _check_spec(spec: Any) -> tuple[str, np.dtype, tuple[int, ...]]:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise WireError(f"an array is described as [name, dtype, shape], not {spec!r}")
    name, dtype_name, shape = spec
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if not isinstance(name, str) or dtype is None:
        raise WireError(f"array {name!r}: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    if not (
        isinstance(shape, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(f"array {name!r}: shape {shape!r} is not a list of dimensions >= 0")
    return name, dtype, tuple(shape)
