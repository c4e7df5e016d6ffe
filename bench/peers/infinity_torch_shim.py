"""Installed into Infinity's virtualenv by `make bench-infinity`: the names optimum 1.27's ONNX
exporter imports from torch.onnx.symbolic_opset14, which torch 2.13 no longer has. Infinity
imports that exporter to load its ONNX engine; serving a model already in ONNX never calls
them, so only the import must succeed."""

import types

import torch.onnx.symbolic_opset14 as opset14


def _decorator(*args, **kwargs):
    return lambda f: f


_helper = types.SimpleNamespace(parse_args=_decorator, quantized_args=_decorator)
_jit = types.SimpleNamespace(GraphContext=object)
for name, value in {
    "_attention_scale": lambda *a, **k: None,
    "_causal_attention_mask": lambda *a, **k: None,
    "_onnx_symbolic": _decorator,
    "_type_utils": types.SimpleNamespace(),
    "jit_utils": _jit,
    "symbolic_helper": _helper,
}.items():
    if not hasattr(opset14, name):
        setattr(opset14, name, value)
