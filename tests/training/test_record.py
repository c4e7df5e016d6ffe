"""`bertserve evaluate --record`: the figure goes into bundle.json with the machine it was
measured on, since an int8 model's answers differ with the CPU's instruction sets."""

from __future__ import annotations

import json
import shutil

import onnxruntime

from bertserve.model.training.evaluate import machine, record

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx fma avx2 bmi2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx fma avx2 bmi2 sha_ni
"""


def test_the_machine_names_the_cpu_and_its_kernel_instruction_sets(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    assert machine(cpuinfo) == {
        "cpu": "AMD EPYC 7B13",
        "isa": ["avx2", "fma"],  # in KERNEL_FEATURES' order; the others are not kernel choices
        "onnxruntime": onnxruntime.__version__,
    }
    assert machine(tmp_path / "missing")["isa"] == []


def test_a_recorded_figure_carries_its_machine(bundle_dir, tmp_path):
    bundle = tmp_path / "sentiment"
    shutil.copytree(bundle_dir / "sentiment", bundle)
    record(bundle, "classify", {"accuracy": 90.0, "examples": 10})
    recorded = json.loads((bundle / "bundle.json").read_text())["metrics"]["classify"]
    assert recorded["accuracy"] == 90.0 and recorded["examples"] == 10
    assert recorded["machine"] == machine()
