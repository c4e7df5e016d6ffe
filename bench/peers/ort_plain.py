"""Peer 2: FastAPI + ONNX Runtime, one model call per request, no batching.

    python -m bench.peers.ort_plain --bundle bundles/sst2-distilled-2x192 --port 8102

A plain `def` endpoint, so FastAPI runs each request in its thread pool and ONNX Runtime sessions
are called concurrently (InferenceSession.run is thread-safe).
"""

from __future__ import annotations

from bench.peers.common import OrtClassifier, parse_args, serve_plain_fastapi


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    model = OrtClassifier(args.bundle)
    serve_plain_fastapi(lambda text: model.answers(model.logits([text]))[0], args.port)


if __name__ == "__main__":
    main()
