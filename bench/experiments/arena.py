"""ONNX Runtime's CPU memory arena against what a worker keeps after its largest call.

Each variant runs in a fresh process on one bundle: warm-up shapes, then batch-1 calls timed,
then the largest call the batcher makes (max_batch_tokens of the longest sequences), then the
batch-1 calls again. It reports resident memory (warm, after the large call, after the small
calls once more) and the batch-1 call's median, so a setting that gives memory back is weighed
against what it costs the common call. Variants alternate over rounds, on one thread.

    bertserve bench arena --bundle bundles/squad-minilm --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = ("arena", "shrink", "no-arena")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def feeds(rows: int, length: int, inputs: list[str]) -> dict[str, np.ndarray]:
    out = {
        "input_ids": np.full((rows, length), 1000, np.int64),
        "attention_mask": np.ones((rows, length), np.int64),
        "token_type_ids": np.zeros((rows, length), np.int64),
    }
    if "mask_positions" in inputs:
        out["mask_positions"] = np.ones((rows, 1), np.int64)
    return {k: v for k, v in out.items() if k in inputs}


def one(bundle: Path, variant: str, max_tokens: int, small: int) -> dict[str, float]:
    from bertserve.runtime.bundle import load_bundle_spec
    from bertserve.runtime.engine import Engine, EngineOptions

    spec = load_bundle_spec(bundle)
    engine = Engine(bundle, spec, EngineOptions(threads=1, cpu_arena=variant))
    length = spec.max_seq_len
    for rows, size in ((1, 16), (32, 32), (2, length)):  # the service's warm-up shapes
        engine.run(feeds(rows, size, spec.inputs))
    engine.warmed()
    warm = rss_mb()

    def smalls() -> float:
        times = []
        for _ in range(small):
            started = time.perf_counter()
            engine.run(feeds(1, 16, spec.inputs))
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)

    small_before = smalls()
    started = time.perf_counter()
    engine.run(feeds(max(1, max_tokens // length), length, spec.inputs))
    large_ms = 1000 * (time.perf_counter() - started)
    after_large = rss_mb()
    small_after = smalls()
    return {
        "warm_mb": warm,
        "after_large_mb": after_large,
        "after_smalls_mb": rss_mb(),
        "small_ms_before": small_before,
        "small_ms_after": small_after,
        "large_ms": large_ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/squad-minilm"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8192, help="the batcher's cap")
    parser.add_argument("--small", type=int, default=300, help="batch-1 calls timed")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(one(args.bundle, args.variant, args.max_tokens, args.small)))
        return
    print(f"{args.bundle}, one thread, {args.rounds} rounds; MB resident, ms a call")
    print("variant   warm  after-large  after-smalls  batch-1 before/after  large call")
    for _ in range(args.rounds):
        for variant in VARIANTS:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.experiments.arena",
                    "--bundle",
                    str(args.bundle),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--small",
                    str(args.small),
                    "--variant",
                    variant,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{variant:8s} {r['warm_mb']:5.0f} {r['after_large_mb']:11.0f} "
                f"{r['after_smalls_mb']:13.0f} {r['small_ms_before']:10.2f} / "
                f"{r['small_ms_after']:.2f} {r['large_ms']:11.0f}"
            )


if __name__ == "__main__":
    main()
