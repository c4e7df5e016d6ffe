"""Export: a checkpoint our model loads (ours or Hugging Face's) -> an ONNX graph, optimised by
ONNX Runtime's transformer optimiser, in fp32 / fp16 / int8 -> a servable bundle."""
