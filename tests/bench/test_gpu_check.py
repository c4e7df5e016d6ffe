"""bench/gpu_check.py rehearsed on the CPU (every step, the CPU provider in CUDA's place), and
the real thing on a machine without CUDA: it stops at the first step and says why."""

from __future__ import annotations

import json

import pytest

from bench.gpu_check import main

pytestmark = pytest.mark.slow


def test_rehearsal_runs_every_step(bundle_dir, tmp_path):
    out = tmp_path / "gpu.json"
    assert (
        main(["--bundles", str(bundle_dir), "--out", str(out), "--rehearse", "--load-seconds", "2"])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["provider_under_test"] == "CPUExecutionProvider"
    steps = ("loads_on_cuda", "answers_vs_cpu", "raw_ort", "classify_under_load")
    for step in (*steps, "classify_under_load_engine_process"):
        assert "failed" not in report[step], report[step]
    for result in report["answers_vs_cpu"].values():
        assert result["fp32"]["max_abs_diff"] == 0.0  # the same provider: identical
        assert result["fp16"]["top1_agreement"] >= 0.9
    # the fill-mask graph without mask slots (what lets /nsp skip the MLM head) on the CPU
    slots = report["answers_vs_cpu"]["pretrained"]["fp32_without_mask_slots"]
    assert slots["max_abs_diff"] < 1e-5, slots
    assert {"fp32_batch128", "fp16_batch1"} <= set(report["raw_ort"])
    load = report["classify_under_load"]
    # 64 closed-loop connections on a loaded 2-core CI machine may fill the queue past
    # BERTSERVE_MAX_QUEUE_WAIT_MS: a 429 is admission control answering, anything else is not.
    assert set(load["statuses"]) <= {"200", "429"} and load["statuses"].get("200", 0) > 0
    assert load["requests_per_s"] > 0
    engine = report["classify_under_load_engine_process"]
    assert set(engine["statuses"]) <= {"200", "429"} and engine["statuses"].get("200", 0) > 0
    assert engine["settings"]["BERTSERVE_ENGINE_PROCESS"] == "true"
    # the engine process ran the calls: its metrics are in the workers' scrape
    assert any(k.startswith("bertserve_engine_batch_rows_count") for k in engine["metrics"])


def test_without_cuda_it_stops_at_the_first_step_and_says_why(bundle_dir, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["--bundles", str(bundle_dir), "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["loads_on_cuda"]["failed"].startswith("this ONNX Runtime offers no CUDA provider")
    assert "answers_vs_cpu" not in report
    assert "loads_on_cuda failed" in capsys.readouterr().err


def test_the_gpu_check_needs_no_torch():
    """Its venv has onnxruntime-gpu, onnx and httpx, not torch: everything it imports must load
    with torch absent (it once imported export.graph, which needs torch)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; "
        "import bench.gpu_check, bertserve.export.variants; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


def test_int8_bundles_are_checked_without_an_fp16_twin(tmp_path, monkeypatch):
    """The shipped int8 graphs (QAttention, DynamicQuantizeMatMul) have no fp16 form: making one
    stopped the whole check at the first int8 bundle (DequantizeLinear refused float16)."""
    from pathlib import Path

    from bench import gpu_check

    monkeypatch.setattr(gpu_check, "TARGET", gpu_check.CPU)
    shipped = Path(__file__).resolve().parents[2] / "bundles"
    result = gpu_check.check_answers([shipped / "sst2-distilled-2x192"], tmp_path)
    answers = result["sst2-distilled-2x192"]
    assert answers["fp16"] == {"skipped": "int8-int4-embeddings graph: no fp16 twin"}
    assert answers["fp32"]["top1_agreement"] == 1.0
