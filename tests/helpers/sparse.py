"""Tiny sentence-transformers `SparseEncoder` directories, saved as sentence-transformers 5.7
saves them: a SPLADE encoder (Transformer for fill-mask + SpladePooling) of any family, and an
inference-free one (a Router whose queries go to a SparseStaticEmbedding)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers.checkpoints import TINY_SHAPE, write_vocab
from tests.helpers.families import family_checkpoint


def mlm_checkpoint(root: Path, family: str, seed: int = 0) -> Path:
    """A random MLM checkpoint of `family` ("bert" or one of tests/helpers/families.py's)."""
    if family != "bert":
        return family_checkpoint(root, family, "fill-mask", seed)
    directory = root / "bert-fill-mask"
    torch.manual_seed(seed)
    config = transformers.BertConfig(**TINY_SHAPE, max_position_embeddings=128)
    transformers.BertForMaskedLM(config).eval().save_pretrained(directory)
    write_vocab(directory / "vocab.txt")
    transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(
        directory
    )
    return directory


def sparse_encoder(
    root: Path,
    family: str = "bert",
    inference_free: bool = False,
    pooling: str = "max",
    activation: str = "relu",
    prompts: dict[str, str] | None = None,
) -> Path:
    """A SparseEncoder over a random MLM of `family`, saved under `root`; with
    `inference_free`, its queries are weighted by a random SparseStaticEmbedding."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    mlm = mlm_checkpoint(root / "mlm", family)
    name = f"{family}-{'free' if inference_free else 'splade'}-{pooling}-{activation}"

    def splade() -> list[torch.nn.Module]:
        return [
            Transformer(str(mlm), transformer_task="fill-mask"),
            SpladePooling(pooling, activation_function=activation),
        ]

    if inference_free:
        modules = splade()
        torch.manual_seed(1)
        vocab = modules[0].auto_model.config.vocab_size
        static = SparseStaticEmbedding(tokenizer=modules[0].tokenizer, weight=torch.rand(vocab))
        router = Router.for_query_document(query_modules=[static], document_modules=modules)
        model = SparseEncoder(modules=[router], prompts=prompts)
    else:
        model = SparseEncoder(modules=splade(), prompts=prompts)
    model.save(str(root / name))
    return root / name
