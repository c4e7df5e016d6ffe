"""Quantised embeddings: int8, uint8, binary and ubinary vectors, as sentence-transformers'
`quantize_embeddings` computes them and Cohere's `embedding_types` names them.

- int8 / uint8: each component cut into 256 buckets between its calibrated minimum and maximum
  (`floor((x - min) / ((max - min) / 255))`, clipped to 0..255; int8 is that less 128). The
  ranges are the bundle's (bundle.json `quantization`, written by `bertserve calibrate` from
  the unit vectors of real texts), one set a width a request may keep, never the request's own
  vectors: a vector's int8 form does not depend on what it was sent with.
- binary / ubinary: one bit a component (positive: 1), packed eight to a byte, big-endian
  (numpy's packbits); binary is the byte less 128, as Cohere's and sentence-transformers' are.
  No calibration.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from bertserve.runtime.errors import InvalidInput
from bertserve.runtime.tasks.common import TaskContext

Precision = Literal["float", "int8", "uint8", "binary", "ubinary"]
CALIBRATED = ("int8", "uint8")
# The most bytes one value takes as JSON, by type: "-128," or "255,"; a float's 15.
VALUE_BYTES = {"float": 15, "base64": 6, "int8": 5, "uint8": 4, "binary": 5, "ubinary": 4}


def values(precision: str, width: int) -> int:
    """How many values a vector of `width` components is in `precision` (binary: a byte for
    eight components)."""
    return -(-width // 8) if precision in ("binary", "ubinary") else width


def check_precision(
    ctx: TaskContext, precisions: list[str], dimensions: int | None, normalize: bool
) -> None:
    """A 422 for a quantised type the bundle cannot answer as asked: int8 / uint8 need its
    calibration at this width, of unit vectors."""
    if not any(p in CALIBRATED for p in precisions):
        return
    name = ctx.spec.name
    width = dimensions or ctx.spec.architecture.hidden_size
    if not ctx.ranges:
        raise InvalidInput(
            f"model {name} has no int8 calibration (bundle.json quantization): calibrate it "
            f"with `bertserve calibrate bundles/{name} --data TEXTS`, or ask for binary or "
            "ubinary vectors, which need none"
        )
    if width not in ctx.ranges:
        raise InvalidInput(
            f"model {name}'s int8 ranges are calibrated for {sorted(ctx.ranges)} components, "
            f"not {width}: ask for one of those dimensions"
        )
    if not normalize:
        raise InvalidInput(
            f"model {name}'s int8 ranges are those of unit vectors: int8 and uint8 need "
            "normalize true"
        )


def quantize(vector: np.ndarray, precision: str, ranges: dict[int, np.ndarray]) -> np.ndarray:
    """One vector (float32) in `precision`: float32 as it is, else int8 / uint8 with the
    ranges of its width, or packed bits."""
    if precision == "float":
        return vector
    if precision in CALIBRATED:
        low, high = ranges[len(vector)]
        steps = (high - low) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((vector - low) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    bits = np.packbits(vector > 0)
    return bits if precision == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)


def calibration_ranges(vectors: np.ndarray, widths: list[int]) -> np.ndarray:
    """float32 (len(widths), 2, hidden): for each width, the minimum and maximum of each of
    the first `width` components of `vectors` (unit vectors of the full width) cut to that
    width and normalised again, as a request's `dimensions` computes them; columns past the
    width are 0."""
    hidden = vectors.shape[1]
    out = np.zeros((len(widths), 2, hidden), dtype=np.float32)
    for i, width in enumerate(widths):
        cut = vectors[:, :width].astype(np.float32)
        cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
        out[i, 0, :width] = cut.min(axis=0)
        out[i, 1, :width] = cut.max(axis=0)
    return out
