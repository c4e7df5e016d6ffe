"""What the peers share: the bundle's ONNX session and tokenizer, batching of token ids, and the
answer format."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    return parser.parse_args()


class OrtClassifier:
    """The bundle's model in ONNX Runtime with its tokenizer: texts in, answers out."""

    def __init__(self, bundle: Path) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.spec = json.loads((bundle / "bundle.json").read_text())
        options = ort.SessionOptions()
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(bundle / self.spec["model_file"]), options, providers=["CPUExecutionProvider"]
        )
        self.tokenizer = Tokenizer.from_file(str(bundle / self.spec["tokenizer"]["file"]))
        self.tokenizer.enable_truncation(self.spec["max_seq_len"])
        self.tokenizer.no_padding()
        self.pad_id = self.spec["tokenizer"]["pad_id"]
        self.labels = self.spec["labels"]

    def feeds(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encodings)
        ids = np.full((len(texts), width), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, e in enumerate(encodings):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}

    def logits(self, texts: list[str]) -> np.ndarray:
        return self.session.run(["logits"], self.feeds(texts))[0]

    def answers(self, logits: np.ndarray) -> list[list[dict]]:
        return [answer(row, self.labels) for row in logits]


def answer(logits: np.ndarray, labels: list[str]) -> list[dict]:
    """Top-1 label with its softmax score: the text-classification pipeline's default answer."""
    z = np.exp(logits - logits.max())
    p = z / z.sum()
    best = int(p.argmax())
    return [{"label": labels[best], "score": float(p[best])}]


class Body(BaseModel):  # module level: FastAPI resolves the endpoint's annotations here
    inputs: str


def serve_plain_fastapi(classify: Callable[[str], list[dict]], port: int) -> None:
    """The server most users write first: FastAPI, a sync endpoint (run in FastAPI's thread
    pool), one model call per request, no access log."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/classify")
    def endpoint(body: Body) -> list[dict]:
        return classify(body.inputs)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
