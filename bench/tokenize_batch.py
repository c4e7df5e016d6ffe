"""Does tokenising a batch in one call cost less CPU than one call a text?

    python -m bench.tokenize_batch --bundle bundles/sst2-distilled-2x192

The service tokenises each input with `Tokenizer.encode` on the event loop (or a worker thread
for large requests). `encode_batch` releases the GIL and, with TOKENIZERS_PARALLELISM, spreads a
batch over every core; on a machine whose cores already run the model and the event loops, what
matters is the CPU a text costs, measured here single-threaded, in one process, the three ways
alternated for several rounds. Texts: the SST-2 dev sentences.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # CPU a text, not wall time over cores


def main() -> None:
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/sst2-distilled-2x192"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data/sst2/dev.tsv"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tok = Tokenizer.from_file(str(args.bundle / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    lines = args.data.read_text(encoding="utf-8").splitlines()[1:]
    texts = [line.split("\t")[0] for line in lines]

    def per_text() -> None:
        for text in texts:
            tok.encode(text)

    def batched() -> None:
        for i in range(0, len(texts), args.batch):
            tok.encode_batch(texts[i : i + args.batch])

    ways = {"encode, one call a text": per_text, f"encode_batch, {args.batch} a call": batched}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            start = time.process_time()
            way()
            times[name].append((time.process_time() - start) / len(texts) * 1e6)
    print(f"{len(texts)} texts, {args.rounds} rounds, CPU microseconds a text (median, min)")
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.1f} (min {min(values):.1f})")


if __name__ == "__main__":
    main()
