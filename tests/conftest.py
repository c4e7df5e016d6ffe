"""Shared fixtures: tiny transformers checkpoints (and bundles of them) built once a session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# Google's bert-base-uncased vocab.txt (Apache-2.0; md5 64800d5d8528ce344256daf115d4965e): the
# token-id parity tests need only this, so it ships with the tests.
BERT_VOCAB = Path(__file__).resolve().parent / "fixtures" / "bert-base-uncased" / "vocab.txt"


def shared_data(*parts: str) -> Path:
    """A file of ../shared/data (development and CI only); skips the test where it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is not present")
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tests.helpers.checkpoints import make_checkpoints

    return make_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def bundle_dir(checkpoints, tmp_path_factory) -> Path:
    """One directory with a bundle for every task: pre-training (fill-mask + nsp), classify,
    ner, qa, exported from the tiny checkpoints."""
    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("bundles")
    for name, arch, task in (
        ("pretrained", "BertForPreTraining", "fill-mask"),
        ("sentiment", "BertForSequenceClassification", "classify"),
        ("entities", "BertForTokenClassification", "ner"),
        ("squad", "BertForQuestionAnswering", "qa"),
    ):
        build_bundle(checkpoints[arch], [task], root / name)
    return root


@pytest.fixture
def tiny_config():
    """A 2-layer, 32-wide BERT config with three labels (model and training unit tests)."""
    from bertserve.model.config import BertConfig
    from tests.helpers.checkpoints import TINY_SHAPE

    return BertConfig(
        **TINY_SHAPE,
        max_position_embeddings=64,
        type_vocab_size=2,
        id2label={0: "NEG", 1: "POS", 2: "NEU"},
    )
