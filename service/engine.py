"""ONNX Runtime session for one bundle: providers from settings (CUDA with CPU fallback, or a hard
requirement for CUDA), intra-op threads sized to the cores, IO binding on CUDA, warm-up."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from service.bundle import BundleSpec
from service.settings import Settings

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    pass


class Engine:
    def __init__(self, directory: Path, spec: BundleSpec, settings: Settings) -> None:
        import onnxruntime as ort

        available = ort.get_available_providers()
        providers = settings.provider_list(available)
        missing = [p for p in providers if p not in available]
        if missing:
            raise EngineError(
                f"providers {missing} are not in this ONNX Runtime build (available: {available})"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if settings.intra_op_spinning else "0"
        )
        options.log_severity_level = 3
        path = directory / spec.model_file
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # ORT's own exception types
            raise EngineError(f"{path}: ONNX Runtime cannot load it: {exc}") from exc
        self.provider = self.session.get_providers()[0]
        if settings.require_gpu and self.provider != "CUDAExecutionProvider":
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
