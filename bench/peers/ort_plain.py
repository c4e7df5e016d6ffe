"""Peer 2: FastAPI + ONNX Runtime, one model call per request, no batching.

    python -m bench.peers.ort_plain --bundle bundles/sst2-classify --port 8102

A plain `def` endpoint, so FastAPI runs each request in its thread pool and ONNX Runtime sessions
are called concurrently (InferenceSession.run is thread-safe).
"""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.peers.common import OrtClassifier, parse_args


class Body(BaseModel):
    inputs: str


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    model = OrtClassifier(args.bundle)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/classify")
    def classify(body: Body) -> list[dict]:
        return model.answers(model.logits([body.inputs]))[0]

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
