"""What runs a bundle, below the HTTP service and free of torch: the bundle format
(`bundle.py`), each task's pre- and post-processing (`tasks/`), the input-encoding schemes
(`encoding.py`), the ONNX Runtime engine (`engine.py`) and the dynamic batcher
(`batching.py`). `service/` serves it over HTTP; `export/` and `model/training/` use it to
write bundles and to evaluate exactly what is served. It imports nothing else of ours."""
