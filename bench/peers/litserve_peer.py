"""Peer 3: LitServe with its batching on (max batch and wait as the service's defaults).

python -m bench.peers.litserve_peer --bundle bundles/sst2-distilled-2x192 --port 8103
"""

from __future__ import annotations

import litserve as ls
import numpy as np

from bench.peers.common import OrtClassifier, parse_args


class ClassifyAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = OrtClassifier(self.bundle)

    def decode_request(self, request: dict) -> str:
        return request["inputs"]

    def batch(self, inputs: list[str]) -> list[str]:
        return inputs

    def predict(self, texts: list[str]) -> np.ndarray:
        return self.model.logits(texts)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, logits: np.ndarray) -> list[dict]:
        return self.model.answers(logits[None])[0]


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    api = ClassifyAPI(
        max_batch_size=args.max_batch, batch_timeout=args.max_wait_ms / 1000, api_path="/classify"
    )
    api.bundle = args.bundle
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
