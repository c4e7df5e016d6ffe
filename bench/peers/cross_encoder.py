"""The rerank peer: FastAPI around sentence-transformers' CrossEncoder on torch, the server a
user writes first. One request's documents in one `predict` call, no batching across requests.

    python -m bench.peers.cross_encoder --bundle bundles/rerank-minilm --port 8102

It loads the checkpoint the bundle was exported from (bundle.json source.checkpoint), after
checking the weights' sha256 against the bundle's record: the peer serves our model. It answers
/rerank in text-embeddings-inference's schema (`query`, `texts` -> `[{index, score}]`), and
/classify with 200 for the bench's readiness check.
"""

from __future__ import annotations

import json
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.peers.common import parse_args
from bertserve.model.checkpoint import sha256, weights_path


class RerankBody(BaseModel):
    query: str
    texts: list[str]
    truncate: bool = True


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    from sentence_transformers import CrossEncoder

    spec = json.loads((args.bundle / "bundle.json").read_text())
    checkpoint = Path(spec["source"]["checkpoint"])
    if sha256(weights_path(checkpoint)) != spec["source"]["sha256"]:
        raise SystemExit(f"{checkpoint} is not the checkpoint {args.bundle} was exported from")
    model = CrossEncoder(str(checkpoint), device="cpu", max_length=spec["max_seq_len"])
    app = FastAPI()

    @app.post("/rerank")
    def rerank(body: RerankBody) -> list[dict]:
        scores = model.predict([(body.query, t) for t in body.texts])
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
        return [{"index": i, "score": float(scores[i])} for i in order]

    @app.post("/classify")
    def ready() -> dict:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
