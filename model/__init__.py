"""The from-scratch BERT in PyTorch: config, encoder, task heads, checkpoints and tokenizer.

It knows nothing of HTTP or ONNX; `export/` and `model.training` build on it, `service/` never
imports it.
"""
