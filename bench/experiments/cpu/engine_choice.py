"""Does `auto` pick the faster engine? A bundle on ONNX Runtime, on OpenVINO and on `auto`, all
three loaded in this one process, their raw ceilings measured in alternating rounds.

    bertserve bench engine-choice --bundle bundles/squad-minilm \
        --openvino-precision bf16 [--rounds 3] [--seconds 1.5] [--out docs/reports/x.json]

Each round measures the three in turn (the order reversed every other round) with
bench.ceiling's length-sorted batches over the /classify bodies; the figure is the median over
rounds. `auto` passes when the engine it chose, forced, reaches at least 0.95x the faster forced
engine's ceiling (the issue's target: never slower by more than 5%); the auto arm's own figure
runs that same engine, and its distance from the forced arm is the rounds' spread. Prints one
JSON line a round and the summary. Pause any background job first: the two cores are the
measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.ceiling import ceiling, classify_rows, load
from bench.run import commit, machine

ROOT = Path(__file__).resolve().parents[3]
ARMS = ("ort", "openvino", "auto")
WITHIN = 0.95  # auto's ceiling against the faster forced engine's


def summarise(per_round: list[dict[str, float]], chosen: str) -> dict:
    """Medians per arm, the faster forced engine, and the engine auto chose (its forced arm's
    figure) against it. The auto arm runs the same engine as that forced arm; its own figure
    against the faster says how much the rounds spread."""
    median = {arm: statistics.median(r[arm] for r in per_round) for arm in ARMS}
    faster = max(("ort", "openvino"), key=lambda arm: median[arm])
    picked = "openvino" if chosen == "openvino" else "ort"
    ratio = median[picked] / median[faster]
    return {
        "median_sequences_per_s": {k: round(v, 1) for k, v in median.items()},
        "faster": faster,
        "auto_chose": picked,
        "chosen_vs_faster": round(ratio, 3),
        "auto_arm_vs_faster": round(median["auto"] / median[faster], 3),
        "within": WITHIN,
        "passed": ratio >= WITHIN,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--bodies", type=Path, default=ROOT / "runs/bench/inputs/classify.jsonl")
    parser.add_argument("--openvino-precision", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    args = parser.parse_args()

    engines = {arm: load(args.bundle, 0, arm, args.openvino_precision) for arm in ARMS}
    auto = engines["auto"][0]
    chosen = auto.engine_name
    ctx = engines["ort"][1]
    rows = classify_rows(ctx, args.bodies)
    pad = ctx.spec.tokenizer.pad_id
    per_round = []
    for r in range(args.rounds):
        arms = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
        figures = {
            arm: ceiling(engines[arm][0], rows, pad, (16, 32), args.seconds)["sequences_per_s"]
            for arm in arms
        }
        per_round.append(figures)
        print(json.dumps({"round": r} | {k: round(v, 1) for k, v in figures.items()}), flush=True)
    result = {
        "bundle": args.bundle.name,
        "openvino_precision": args.openvino_precision,
        "engine_choice": auto.engine_choice,
        "machine": machine(),
        "commit": commit(),
        "rounds": per_round,
    } | summarise(per_round, chosen)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
