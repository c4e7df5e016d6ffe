#!/usr/bin/env bash
# The GPU check, on a machine with one NVIDIA GPU and PyPI: a fresh virtualenv with the
# `gpu-wheels` extra (onnxruntime-gpu and NVIDIA's CUDA/cuDNN wheels, no CUDA image needed),
# then bench/gpu_check.py's five steps; JSON results in $OUT (or runs/). Under 6 minutes.
# On a machine without a GPU it stops at the first step and says why (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=${OUT:-runs}
python=${PYTHON:-$(command -v python3.12 || command -v python3.11 || command -v python3)}
venv=$(mktemp -d)/venv
"$python" -m venv "$venv"
export PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# onnx converts the fp32 graph to fp16 for step 2; httpx drives step 4.
"$venv/bin/pip" install ".[gpu-wheels]" onnx httpx
"$venv/bin/python" -m bench.gpu_check --bundles bundles --out "$out_dir/gpu_check.json"
