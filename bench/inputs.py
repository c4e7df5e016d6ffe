"""Real request bodies for the load generator, one JSON document per line, from the shared data:

- classify: SST-2 dev sentences (3 to 60 tokens: the mixed lengths the padding target is about)
- ner: CoNLL-2003 test (eng.testb) sentences, words joined by spaces
- qa: SQuAD v1.1 dev question/context pairs (contexts often longer than one window)
- fill-mask: the first sentence (up to 40 words) of SQuAD dev contexts, one mid-sentence word
  masked
- nsp: two consecutive sentences of a SQuAD dev context, with truncation on

    python bench/inputs.py --data ../shared/data --out runs/bench/inputs
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from bertserve.model.training.data.tasks import read_conll, read_squad, read_sst2

ENDPOINTS = ("classify", "ner", "qa", "fill-mask", "nsp")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_MASKABLE = re.compile(r"^[A-Za-z]{4,}$")


def _sentences(context: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(context) if len(s.split()) >= 5]


def bodies(endpoint: str, data: Path, limit: int = 2000, seed: int = 0) -> list[dict]:
    """Request bodies for `endpoint` in a fixed pseudo-random order (the same on every run)."""
    rng = random.Random(seed)
    out: list[dict]
    if endpoint == "classify":
        out = [{"inputs": e.text} for e in read_sst2(data / "sst2", "dev")]
    elif endpoint == "ner":
        out = [{"inputs": " ".join(s.words)} for s in read_conll(data / "conll2003", "test")]
    elif endpoint == "qa":
        out = [
            {"inputs": {"question": e.question, "context": e.context}}
            for e in read_squad(data / "squad-v1.1", "dev")
        ]
    else:
        contexts = list(dict.fromkeys(e.context for e in read_squad(data / "squad-v1.1", "dev")))
        out = []
        for context in contexts:
            sentences = _sentences(context)
            if endpoint == "nsp" and len(sentences) >= 2:
                pair = {"text": sentences[0], "text_pair": sentences[1]}
                # The pre-trained bundle takes 128 tokens; long pairs are cut, as a client would.
                out.append({"inputs": pair, "parameters": {"truncation": True}})
            elif endpoint == "fill-mask" and sentences and len(sentences[0].split()) <= 40:
                words = sentences[0].split()
                middle = [i for i in range(1, len(words) - 1) if _MASKABLE.match(words[i])]
                if middle:
                    words[rng.choice(middle)] = "[MASK]"
                    out.append({"inputs": " ".join(words)})
    if not out:
        raise ValueError(f"no {endpoint} inputs found under {data}")
    rng.shuffle(out)
    return out[:limit]


def write_bodies(endpoint: str, data: Path, out_dir: Path, limit: int = 2000) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{endpoint}.jsonl"
    lines = [json.dumps(b, ensure_ascii=False) for b in bodies(endpoint, data, limit)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench/inputs"))
    parser.add_argument("--limit", type=int, default=2000)
    args = parser.parse_args()
    for endpoint in ENDPOINTS:
        path = write_bodies(endpoint, args.data, args.out, args.limit)
        print(f"{path}: {sum(1 for _ in path.open())} bodies")


if __name__ == "__main__":
    main()
