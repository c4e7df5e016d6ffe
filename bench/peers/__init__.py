"""The servers users would otherwise pick, each serving the same bundle's model on POST /classify
with the body our service takes (`{"inputs": "..."}`) and the answer it gives
(`[{"label": ..., "score": ...}]`), started and stopped by `bench/run.py`:

- `hf_pipeline`: FastAPI + a transformers text-classification pipeline on torch, no batching
  (what most users write first). Its weights are read out of the bundle's ONNX file and checked
  against ONNX Runtime at start-up, so it is the same model, not a look-alike.
- `ort_plain`: FastAPI + ONNX Runtime, one model call per request, no batching.
- `litserve_peer`: LitServe with its batching on.
- `ray_peer`: Ray Serve with `@serve.batch`.

Every peer tokenises with the bundle's tokenizer.json and uses every core for the model, as the
service does (`intra_op_threads=0`).
"""
