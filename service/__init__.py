"""The inference service: FastAPI + a dynamic-batching queue on ONNX Runtime.

It imports neither torch nor anything else of this project: a serving install has no torch.
"""
