"""The GPU check (`bench/gpu_check.sh` runs it in a fresh `gpu-wheels` virtualenv): on a machine
with one NVIDIA GPU, does the CUDA provider really run every shipped bundle, with the CPU's
answers, how fast, and how does the service batch under load there. Writes one JSON file.

    bertserve bench gpu-check --bundles bundles --out runs/gpu_check.json

Steps (each recorded; the first failure stops the run with its reason):
1. every bundle loads on CUDAExecutionProvider (BERTSERVE_REQUIRE_GPU's check), and which of its
   nodes ONNX Runtime left on the CPU (int8 dynamic quantisation has no CUDA kernels);
2. every task's answers on CUDA against the CPU's, through the service's own task code, on the
   fp32 graph and on an fp16 conversion of it; for a fill-mask graph, whether CUDA runs it with
   no mask slots (the warm-up probe that lets /nsp skip the MLM head);
3. raw ONNX Runtime at batch 1/8/32/128 x sequence 128, fp32 against fp16;
4. /classify under load (closed loop, 64 connections, 15 s): requests/s, latency, batch sizes,
   stage times, GPU utilisation and memory from /metrics;
5. the same load on the GPU topology: front-end workers (one a core, at most 4) feeding one
   engine process (`BERTSERVE_ENGINE_PROCESS`), with the rows of its merged calls.
On a machine without CUDA it stops at step 1 and says why (exit status 1).
`--rehearse` runs every step with the CPU provider in CUDA's place: the code path, not the
numbers (tests/bench runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bertserve.runtime.batching import without_slots
from bertserve.runtime.bundle import load_bundle_spec
from bertserve.runtime.engine import CPU, CUDA, Engine, EngineError, EngineOptions

SAMPLES = {
    "classify": ["a charming and often affecting journey", "the plot is a mess"] * 4,
    "ner": ["Angela Merkel met Emmanuel Macron in Paris.", "EU rejects German call."] * 4,
    "embed": ["A man is eating food.", "Paris is the capital of France."] * 4,
    "fill-mask": ["Paris is the [MASK] of France."] * 4,
    # one sequence of question and context: the span logits' numbers are what is compared
    "qa": ["Where was Aristotle born? Aristotle was born in Stagira in 384 BC."] * 4,
}


class Failed(RuntimeError):
    pass


TARGET = CUDA  # the provider under test; CPU when rehearsing
TIMING_S = 2.0


def fp32_graph(bundle: Path, work: Path) -> Path:
    """The bundle's graph with ONNX Runtime's basic folding applied (fp16-weights casts become
    fp32 weights again), saved: the fp32 reference and the source of the fp16 conversion."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(work / f"{bundle.name}-fp32.onnx")
    ort.InferenceSession(str(bundle / "model.onnx"), options, providers=[CPU])
    return Path(options.optimized_model_filepath)


def feeds_for(bundle: Path, texts: list[str], length: int | None = None) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    spec = load_bundle_spec(bundle)
    tok = Tokenizer.from_file(str(bundle / spec.tokenizer.file))
    tok.no_padding()
    tok.enable_truncation(spec.max_seq_len)
    encodings = tok.encode_batch(texts)
    width = length or max(len(e.ids) for e in encodings)
    ids = np.zeros((len(texts), width), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encodings):
        n = min(width, len(e.ids))
        ids[i, :n], mask[i, :n] = e.ids[:n], 1
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    if "mask_positions" in spec.inputs:
        feeds["mask_positions"] = np.ones((len(texts), 1), np.int64)
    return feeds


def session(path: Path, provider: str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    chosen: list[Any] = [(CUDA, {"use_tf32": 0}), CPU] if provider == CUDA else [CPU]
    return ort.InferenceSession(str(path), options, providers=chosen)


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    agree = float(np.mean([np.mean(a[k].argmax(-1) == b[k].argmax(-1)) for k in a]))
    return {"max_abs_diff": worst, "top1_agreement": agree}


def check_loads(bundles: list[Path]) -> dict[str, Any]:
    import onnxruntime as ort

    if TARGET not in ort.get_available_providers():
        raise Failed(f"this ONNX Runtime offers no CUDA provider: {ort.get_available_providers()}")
    out = {}
    for bundle in bundles:
        spec = load_bundle_spec(bundle)
        try:
            options = EngineOptions(
                f"{TARGET},{CPU}" if TARGET == CUDA else CPU, require_gpu=TARGET == CUDA
            )
            engine = Engine(bundle, spec, options)
        except EngineError as exc:
            raise Failed(str(exc)) from exc
        out[bundle.name] = {"provider": engine.provider, "precision": spec.precision}
    return out


def check_answers(bundles: list[Path], work: Path) -> dict[str, Any]:
    from bertserve.export.variants import to_fp16

    out = {}
    for bundle in bundles:
        spec = load_bundle_spec(bundle)
        task = next((t for t in spec.tasks if t in SAMPLES), None)
        if task is None:
            continue
        feeds = feeds_for(bundle, SAMPLES[task])
        fp32 = fp32_graph(bundle, work)
        graphs = [("fp32", fp32)]
        result: dict[str, Any] = {}
        if spec.precision.startswith("int8"):
            # Dynamic int8 graphs (QAttention, DynamicQuantizeMatMul) are CPU kernels with no fp16
            # form: on a GPU such a model is exported at fp16 from its checkpoint instead.
            result["fp16"] = {"skipped": f"{spec.precision} graph: no fp16 twin"}
        else:
            fp16 = work / f"{bundle.name}-fp16.onnx"
            to_fp16(fp32, fp16)
            graphs.append(("fp16", fp16))
        cpu = dict(
            zip(
                [o.name for o in session(fp32, CPU).get_outputs()],
                session(fp32, CPU).run(None, feeds),
                strict=True,
            )
        )
        for name, path in graphs:
            gpu = session(path, TARGET)
            outs = dict(zip([o.name for o in gpu.get_outputs()], gpu.run(None, feeds), strict=True))
            result[name] = compare(cpu, outs)
            if "mask_positions" in feeds:
                result[f"{name}_without_mask_slots"] = empty_slots(
                    gpu, feeds, outs, spec.output_axes
                )
        out[bundle.name] = result
    return out


def empty_slots(
    sess: Any, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray], axes: Any
) -> dict[str, Any]:
    """The service's warm-up probe (service.warmup.probe_slots) on this provider: /nsp rows skip
    the MLM head only where the graph runs with mask_positions of width 0 and gives its other
    outputs as at width 1; otherwise the service keeps one slot a row (recorded, not a failure)."""
    names = [o.name for o in sess.get_outputs()]

    def run(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(None, f), strict=True))

    try:
        pairs = without_slots(run, feeds, outputs, axes)
    except Exception as exc:  # the provider's refusal is the finding
        return {"refused": str(exc)[:300]}
    return {"max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs)}


def time_raw(bundle: Path, work: Path) -> dict[str, Any]:
    from bertserve.export.variants import to_fp16

    fp32 = fp32_graph(bundle, work)
    fp16 = work / f"{bundle.name}-timing-fp16.onnx"
    to_fp16(fp32, fp16)
    out: dict[str, Any] = {"bundle": bundle.name, "sequence": 128}
    for name, path in (("fp32", fp32), ("fp16", fp16)):
        gpu = session(path, TARGET)
        for batch in (1, 8, 32, 128):
            feeds = feeds_for(bundle, ["word " * 200] * batch, length=128)
            for _ in range(3):
                gpu.run(None, feeds)
            runs, started = 0, time.perf_counter()
            while time.perf_counter() - started < TIMING_S:
                gpu.run(None, feeds)
                runs += 1
            seconds = (time.perf_counter() - started) / runs
            out[f"{name}_batch{batch}"] = {"ms": 1000 * seconds, "sequences_per_s": batch / seconds}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENGINE_PROCESS = {
    "BERTSERVE_ENGINE_PROCESS": "true",
    "BERTSERVE_WORKERS": str(min(4, os.cpu_count() or 1)),
}


def load_test(
    bundles_dir: Path,
    seconds: float = 15.0,
    connections: int = 64,
    topology: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`topology`: the settings that choose it; None: one worker, which owns the device."""
    import httpx

    port = free_port()
    env = {
        **os.environ,
        "BERTSERVE_PROVIDERS": f"{TARGET},{CPU}" if TARGET == CUDA else CPU,
        "BERTSERVE_REQUIRE_GPU": str(TARGET == CUDA).lower(),
        **(topology or {"BERTSERVE_WORKERS": "1"}),
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bertserve.service",
            "--bundles",
            str(bundles_dir),
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            raise Failed("the service did not become ready on CUDA within 180 s")
        latencies: list[float] = []
        statuses: dict[int, int] = {}

        async def client(c: httpx.AsyncClient, stop: float) -> None:
            while time.monotonic() < stop:
                started = time.perf_counter()
                r = await c.post(
                    "/classify", json={"inputs": "a charming and often affecting journey"}
                )
                latencies.append(time.perf_counter() - started)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        async def run() -> None:
            limits = httpx.Limits(max_connections=connections)
            async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as c:
                stop = time.monotonic() + seconds
                await asyncio.gather(*(client(c, stop) for _ in range(connections)))

        asyncio.run(run())
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        server.terminate()
        server.wait(timeout=60)
    lat = np.asarray(latencies) * 1000
    series = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in metrics.splitlines()
        if line.startswith(
            (
                "bertserve_batch_rows_",
                "bertserve_stage_duration_seconds_sum",
                "bertserve_gpu_",
                "bertserve_engine_",
            )
        )
    }
    return {
        "settings": {k: v for k, v in env.items() if k.startswith("BERTSERVE_")},
        "requests_per_s": len(latencies) / seconds,
        "statuses": statuses,
        "latency_ms": {
            p: float(np.percentile(lat, q)) for p, q in (("p50", 50), ("p95", 95), ("p99", 99))
        },
        "metrics": series,
    }


def timed_bundle(bundles: list[Path]) -> Path:
    """The embedding bundle (the encoder alone, so the numbers are the encoder's), else any."""
    return next((b for b in bundles if "embed" in load_bundle_spec(b).tasks), bundles[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bertserve bench gpu-check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--bundles", type=Path, default=Path("bundles"))
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check.json"))
    parser.add_argument("--rehearse", action="store_true", help="the CPU in CUDA's place")
    parser.add_argument("--load-seconds", type=float, default=15.0)
    args = parser.parse_args(argv)
    global TARGET, TIMING_S
    TARGET, TIMING_S = (CPU, 0.2) if args.rehearse else (CUDA, 2.0)
    bundles = sorted(p.parent for p in args.bundles.glob("*/bundle.json"))
    report: dict[str, Any] = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "provider_under_test": TARGET,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        steps = (
            ("loads_on_cuda", lambda: check_loads(bundles)),
            ("answers_vs_cpu", lambda: check_answers(bundles, work)),
            ("raw_ort", lambda: time_raw(timed_bundle(bundles), work)),
            ("classify_under_load", lambda: load_test(args.bundles, args.load_seconds)),
            (
                "classify_under_load_engine_process",
                lambda: load_test(args.bundles, args.load_seconds, topology=ENGINE_PROCESS),
            ),
        )
        for name, step in steps:
            started = time.monotonic()
            try:
                report[name] = step()
            except Failed as exc:
                report[name] = {"failed": str(exc)}
                print(f"gpu check: {name} failed: {exc}", file=sys.stderr)
                status = 1
                break
            finally:
                report.setdefault("seconds", {})[name] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
