"""ONNX Runtime session for one bundle: providers (CUDA with CPU fallback, or a hard requirement
for CUDA), intra-op threads sized to the cores, IO binding on CUDA. Warm-up is the service's
(ServiceState.warm_up); evaluation builds engines with its own options."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.bundle import BundleSpec

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineOptions:
    providers: str = "auto"  # "auto" (CUDA if this build has it, then CPU) or a list "A,B"
    threads: int = 1  # ONNX Runtime intra-op threads
    spinning: bool = False
    require_gpu: bool = False

    def provider_list(self, available: list[str]) -> list[str]:
        if self.providers == "auto":
            known = ("CUDAExecutionProvider", "CPUExecutionProvider")
            return [p for p in known if p in available]
        return self.providers.split(",")


class Engine:
    def __init__(self, directory: Path, spec: BundleSpec, options: EngineOptions) -> None:
        import onnxruntime as ort

        available = ort.get_available_providers()
        providers = options.provider_list(available)
        missing = [p for p in providers if p not in available]
        if missing:
            raise EngineError(
                f"providers {missing} are not in this ONNX Runtime build (available: {available})"
            )
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = options.threads
        session_options.inter_op_num_threads = 1
        session_options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if options.spinning else "0"
        )
        session_options.log_severity_level = 3
        path = directory / spec.model_file
        try:
            self.session = ort.InferenceSession(str(path), session_options, providers=providers)
        except Exception as exc:  # ORT's own exception types
            raise EngineError(f"{path}: ONNX Runtime cannot load it: {exc}") from exc
        self.provider = self.session.get_providers()[0]
        if options.require_gpu and self.provider != "CUDAExecutionProvider":
            raise EngineError(
                f"BERTSERVE_REQUIRE_GPU is set but {path} runs on {self.provider} "
                f"(available: {available})"
            )
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.inputs = [i.name for i in self.session.get_inputs()]
        if self.inputs != spec.inputs or self.outputs != spec.outputs:
            raise EngineError(
                f"{path}: graph inputs/outputs {self.inputs}/{self.outputs} differ from bundle.json"
            )
        self._io_binding = self.provider == "CUDAExecutionProvider"

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._io_binding:
            binding = self.session.io_binding()
            for name in self.inputs:
                binding.bind_cpu_input(name, feeds[name])
            for name in self.outputs:
                binding.bind_output(name, "cpu")
            self.session.run_with_iobinding(binding)
            return dict(zip(self.outputs, binding.copy_outputs_to_cpu(), strict=True))
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds), strict=True))
