"""Peer 4: Ray Serve with `@serve.batch` (max batch and wait as the service's defaults).

    python -m bench.peers.ray_peer --bundle bundles/sst2-distilled-2x192 --port 8104

Runs a local Ray cluster in this process tree (head node, Serve controller, HTTP proxy, one
replica) and blocks until killed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Ray Serve gives its HTTP proxy 5 s to start; a busy 2-core machine needs longer. Read at
# import by every Ray process, which inherit this environment.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")

import numpy as np
import ray
from ray import serve
from starlette.requests import Request

from bench.peers.common import OrtClassifier, parse_args


def build(bundle: Path, max_batch: int, max_wait_s: float):
    # max_ongoing_requests defaults to 5, which would cap batches at 5: Ray's batching guide
    # sets it above the batch size.
    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4 * max_batch)
    class Classifier:
        def __init__(self) -> None:
            self.model = OrtClassifier(bundle)

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=max_wait_s)
        async def run(self, texts: list[str]) -> list[list[dict]]:
            logits: np.ndarray = self.model.logits(texts)
            return self.model.answers(logits)

        async def __call__(self, request: Request) -> list[dict]:
            body = await request.json()
            return await self.run(body["inputs"])

    return Classifier.bind()  # type: ignore[attr-defined]  # added by @serve.deployment


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(
        build(args.bundle.resolve(), args.max_batch, args.max_wait_ms / 1000),
        route_prefix="/classify",
    )
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
