"""OpenVINO as a second CPU engine, behind the part of ONNX Runtime's session interface that
runtime.engine.Engine uses (`get_inputs`, `get_outputs`, `get_providers`, `run`), so the
batcher, the lone path and the metrics do not know which engine runs a call.

OpenVINO reads the bundle's ONNX graph itself. It cannot read every graph ONNX Runtime runs: the
dynamic-int8 bundles' fused `com.microsoft.QAttention` has no conversion rule (openvino
2026.4), and such a bundle stays on ONNX Runtime (`auto` says why; a forced `openvino` is a
load error naming the operator).

`precision` is OpenVINO's inference precision hint: `f32` answers within fp32's 1e-4 of ONNX
Runtime's; `bf16` runs matrix products in bfloat16 where the CPU has AVX-512 BF16 or AMX (about
1e-2 of the largest output: a precision of its own, measured by `bertserve evaluate` before a
bundle asks for it). A CPU without those instructions runs f32, and `precision_in_use` says so.

An infer request is not thread-safe, and the batcher may run calls of one model from two threads
(bulk and interactive): each thread gets a request of its own from one compiled model.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

OPENVINO = "OpenVINO:CPU"  # what Engine.provider reads for a model OpenVINO runs


def available() -> str | None:
    """None when OpenVINO can run here, else why not (one line)."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "openvino is not installed (pip install '.[openvino]')"
    return None


class _Port:
    def __init__(self, name: str) -> None:
        self.name = name


class OpenVINOSession:
    def __init__(
        self, path: Path, threads: int, precision: str = "f32", names: tuple[str, ...] = ()
    ) -> None:
        """`names`: the graph's input and output names as ONNX Runtime reads them. OpenVINO
        gives a tensor every name it had in the graph (an output is also its node's
        `/.../MatMul_output_0`), and a port is called by the one of its names listed here."""
        import openvino as ov

        core = ov.Core()
        model = core.read_model(str(path))  # raises with the operators it cannot convert
        config = {
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": precision,
            # the workers' threads are not pinned by ONNX Runtime either: several processes
            # share the cores
            "ENABLE_CPU_PINNING": False,
        }
        self.compiled = core.compile_model(model, "CPU", config)
        self.precision_in_use = self.compiled.get_property(
            "INFERENCE_PRECISION_HINT"
        ).get_type_name()

        def name_of(port: Any) -> str:
            return next((n for n in names if n in port.get_names()), port.get_any_name())

        self._inputs = [_Port(name_of(p)) for p in self.compiled.inputs]
        self._outputs = [_Port(name_of(p)) for p in self.compiled.outputs]
        self._names = {
            p.get_any_name(): o.name
            for p, o in zip(self.compiled.outputs, self._outputs, strict=True)
        }
        self._local = threading.local()

    def get_inputs(self) -> list[_Port]:
        return self._inputs

    def get_outputs(self) -> list[_Port]:
        return self._outputs

    def get_providers(self) -> list[str]:
        return [OPENVINO]

    def run(
        self, names: list[str], feeds: dict[str, np.ndarray], options: Any = None
    ) -> list[np.ndarray]:
        """The outputs named, copied out of this thread's request. `options` (ONNX Runtime's
        RunOptions) has no OpenVINO meaning and is ignored."""
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        out = request.infer(feeds, share_inputs=True, share_outputs=True)
        by_name = {self._names[port.get_any_name()]: value for port, value in out.items()}
        return [np.array(by_name[name], copy=True) for name in names]
