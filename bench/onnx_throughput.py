"""Raw ONNX Runtime throughput of a bundle's graph in fp32 / fp16 / int8 against torch eager.

    python bench/onnx_throughput.py --checkpoint checkpoints/pretrained-wiki-tiny --task nsp \
        [--batches 1,8,32] [--seqs 16,64,128] [--seconds 1.5]

The three variants are exported from the checkpoint into a temporary directory, then every
(batch, sequence) cell is timed for each of them and for the torch model on the same random
token ids, in this one process, so the ratios compare like with like. Sequences/s and tokens/s
(batch x sequence / time) are printed as a Markdown table with the machine named.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from bertserve.export.bundle import build_bundle
from bertserve.export.graph import TASK_SPECS, TaskGraph
from bertserve.model.checkpoint import load_model


def timed(fn, seconds: float) -> float:
    """Calls per second over at least `seconds` (after one warm-up call)."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
        fn()
        calls += 1
    return calls / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--task", default="nsp")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--seqs", default="16,64,128")
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3

    with tempfile.TemporaryDirectory() as tmp:
        sessions, tasks = {}, list[str]()
        for precision in ("fp32", "fp16", "int8"):
            out = Path(tmp) / precision
            spec = build_bundle(args.checkpoint, [args.task], out, precision, force=True)
            tasks = spec.tasks
            sessions[precision] = ort.InferenceSession(
                str(out / "model.onnx"), options, providers=["CPUExecutionProvider"]
            )
        model = load_model(args.checkpoint, TASK_SPECS[args.task].architecture).eval()
        graph = TaskGraph(model, tasks)

        print(
            f"machine: {platform.machine()}, {threads} cores, onnxruntime {ort.__version__} "
            f"(CPUExecutionProvider), torch {torch.__version__}; task graph {tasks}"
        )
        print(
            "| batch | seq | torch eager seq/s | fp32 seq/s | fp16 seq/s | int8 seq/s | "
            "fp32 tokens/s | fp32 / torch | int8 / fp32 |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        rng = np.random.default_rng(0)
        for batch in (int(b) for b in args.batches.split(",")):
            for seq in (int(s) for s in args.seqs.split(",")):
                feeds = {
                    "input_ids": rng.integers(5, model.config.vocab_size, (batch, seq)),
                    "attention_mask": np.ones((batch, seq), np.int64),
                    "token_type_ids": np.zeros((batch, seq), np.int64),
                }
                if "fill-mask" in tasks:
                    feeds["mask_positions"] = rng.integers(1, seq, (batch, max(1, seq // 7)))
                tensors = [torch.from_numpy(v) for v in feeds.values()]
                rate = {
                    p: timed(lambda s=s, f=feeds: s.run(None, f), args.seconds) * batch
                    for p, s in sessions.items()
                }
                with torch.inference_mode():
                    rate["torch"] = timed(lambda t=tensors: graph(*t), args.seconds) * batch
                print(
                    f"| {batch} | {seq} | {rate['torch']:,.0f} | {rate['fp32']:,.0f} | "
                    f"{rate['fp16']:,.0f} | {rate['int8']:,.0f} | {rate['fp32'] * seq:,.0f} | "
                    f"{rate['fp32'] / rate['torch']:.2f}x | {rate['int8'] / rate['fp32']:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
