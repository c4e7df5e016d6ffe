"""Peer 1: FastAPI + a transformers text-classification pipeline on torch, one request at a time.

    python -m bench.peers.hf_pipeline --bundle bundles/sst2-distilled-2x192 --port 8101

The weights come out of the bundle's ONNX file (MatMul weights transposed back, ORT's fused QKV
split into query/key/value) and the pipeline's logits are checked against ONNX Runtime's before
the server starts: the peer serves our model, not a look-alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerFast,
    TextClassificationPipeline,
)

from bench.peers.common import OrtClassifier, parse_args, serve_plain_fastapi

PREFIX = "model."


def state_dict_from_onnx(path: Path) -> dict[str, torch.Tensor]:
    """The torch state dict of a classify bundle's graph (exported by `bertserve export`)."""
    graph = onnx.load(str(path)).graph
    arrays = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    transposed = {n.input[1] for n in graph.node if n.op_type == "MatMul"}
    state: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if name.startswith(PREFIX):
            state[name[len(PREFIX) :]] = value.T if name in transposed else value
    for node in graph.node:
        if node.op_type == "Attention":  # ORT's fusion: [hidden, 3 * hidden], q | k | v
            layer = int(node.input[1].split("_")[1])
            weight, bias = arrays[node.input[1]], arrays[node.input[2]]
            for part, w, b in zip(
                ("query", "key", "value"),
                np.split(weight, 3, axis=1),
                np.split(bias, 3),
                strict=True,
            ):
                key = f"bert.encoder.layer.{layer}.attention.self.{part}"
                state[f"{key}.weight"], state[f"{key}.bias"] = w.T, b
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def build_pipeline(bundle: Path) -> TextClassificationPipeline:
    spec = json.loads((bundle / "bundle.json").read_text())
    arch = spec["architecture"]
    labels = spec["labels"]
    state = state_dict_from_onnx(bundle / "model.onnx")
    config = BertConfig(
        vocab_size=arch["vocab_size"],
        hidden_size=arch["hidden_size"],
        num_hidden_layers=arch["layers"],
        num_attention_heads=arch["heads"],
        intermediate_size=state["bert.encoder.layer.0.intermediate.dense.weight"].shape[0],
        max_position_embeddings=arch["max_position_embeddings"],
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    model = BertForSequenceClassification(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    t = spec["tokenizer"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(bundle / t["file"]),
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=spec["max_seq_len"],
    )
    return TextClassificationPipeline(model=model, tokenizer=tokenizer, device=-1)


def check_same_model(pipe: TextClassificationPipeline, bundle: Path, texts: list[str]) -> float:
    """Largest logit difference between the torch model and ONNX Runtime on `texts`."""
    ort = OrtClassifier(bundle)
    assert pipe.tokenizer is not None  # make_pipeline gives it one
    worst = 0.0
    for text in texts:
        enc = pipe.tokenizer(text, return_tensors="pt", truncation=True)
        with torch.no_grad():
            torch_logits = pipe.model(**enc).logits[0].numpy()
        worst = max(worst, float(np.abs(torch_logits - ort.logits([text])[0]).max()))
    return worst


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    pipe = build_pipeline(args.bundle)
    diff = check_same_model(
        pipe, args.bundle, ["a gripping, funny film", "it is dull and far too long .", "ok"]
    )
    if diff > 1e-4:
        raise SystemExit(f"torch and ONNX Runtime logits differ by {diff:.2e}")
    serve_plain_fastapi(lambda text: pipe(text, truncation=True), args.port)


if __name__ == "__main__":
    main()
