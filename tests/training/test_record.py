"""`bertserve evaluate --record`: the figure goes into bundle.json with the machine it was
measured on, since an int8 model's answers differ with the CPU's instruction sets."""

from __future__ import annotations

import json
import shutil

import onnxruntime

from model.training.evaluate import KERNEL_FEATURES, record


def test_a_recorded_figure_names_its_cpu_and_onnxruntime(bundle_dir, tmp_path):
    bundle = tmp_path / "sentiment"
    shutil.copytree(bundle_dir / "sentiment", bundle)
    record(bundle, "classify", {"accuracy": 90.0, "examples": 10})
    recorded = json.loads((bundle / "bundle.json").read_text())["metrics"]["classify"]
    assert recorded["accuracy"] == 90.0
    machine = recorded["machine"]
    assert machine["onnxruntime"] == onnxruntime.__version__
    assert set(machine["isa"]) <= set(KERNEL_FEATURES)
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert machine["isa"] == [f for f in KERNEL_FEATURES if f in flags]
