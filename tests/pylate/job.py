"""Reference ColBERT vectors from PyLate itself, run in its own virtualenv (.venv-pylate), never
in bertserve's: builds PyLate `ColBERT` models over a tiny BERT checkpoint (random projections,
several framings), saves each as PyLate saves it, and writes what `ColBERT.encode` returns for
queries and documents. A directory given instead of the base is only encoded (a checkpoint
saved by bertserve's own trainer).

    .venv-pylate/bin/python tests/pylate/job.py BASE ROOT TEXTS   # ROOT/<case>/, ROOT/expected.json
    .venv-pylate/bin/python tests/pylate/job.py --encode MODEL TEXTS OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cases(base: str) -> dict:
    import torch
    from pylate import models
    from sentence_transformers.models import Transformer

    torch.manual_seed(0)
    out = {
        # PyLate's defaults: "[Q] " and "[D] " added to the vocabulary, queries expanded with
        # unattended [MASK]s, no bias, punctuation skipped in documents.
        "default": models.ColBERT(base, embedding_size=16, device="cpu"),
        # The vocabulary's own markers, attended expansion, short sides, a bias.
        "unused-attend": models.ColBERT(
            base,
            embedding_size=12,
            bias=True,
            query_prefix="[unused0]",
            document_prefix="[unused1]",
            query_length=12,
            document_length=24,
            attend_to_expansion_tokens=True,
            device="cpu",
        ),
        # No query expansion, no query marker, a skiplist of its own.
        "plain-queries": models.ColBERT(
            base,
            embedding_size=8,
            query_prefix="",
            document_prefix="[unused1]",
            do_query_expansion=False,
            skiplist_words=[",", "?"],
            device="cpu",
        ),
    }
    # Two projections, the second with a residual: modules given as PyLate takes them.
    first = models.Dense(32, 24, bias=True, activation_function=torch.nn.Tanh())
    second = models.Dense(24, 24, bias=False, use_residual=True)
    out["two-dense"] = models.ColBERT(
        modules=[Transformer(base), first, second],
        query_prefix="[unused0]",
        document_prefix="[unused1]",
        device="cpu",
    )
    return out


def encode(model, texts: list[str]) -> dict:
    return {
        side: [v.tolist() for v in model.encode(texts, is_query=side == "query")]
        for side in ("query", "document")
    }


def main() -> None:
    from pylate import models

    if sys.argv[1] == "--encode":
        model_dir, texts_path, out = sys.argv[2:5]
        texts = json.loads(Path(texts_path).read_text())
        Path(out).write_text(json.dumps(encode(models.ColBERT(model_dir, device="cpu"), texts)))
        return
    base, root, texts_path = sys.argv[1:4]
    texts = json.loads(Path(texts_path).read_text())
    expected = {}
    for name, model in cases(base).items():
        model.save(str(Path(root) / name))
        # Encoded as a user would: loaded back from the directory saved.
        expected[name] = encode(models.ColBERT(str(Path(root) / name), device="cpu"), texts)
    (Path(root) / "expected.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main()
