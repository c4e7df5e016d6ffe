"""Narrowing a teacher into a student (model/training/shrink.py): exact at full width, the
basis and what it keeps, the heads and units it picks, and the command on a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertserve.model.checkpoint import load_model
from bertserve.model.config import BertConfig
from bertserve.model.heads import BertForPreTraining, BertForTokenClassification
from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.__main__ import main
from bertserve.model.training.shrink import Basis, collect_states, narrow, stream_basis

WIKI = Path(__file__).resolve().parents[1] / "fixtures" / "wiki"


def _teacher(cls=BertForPreTraining, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )
    return cls(config).eval()


def test_a_full_width_identity_basis_reproduces_the_teacher_exactly():
    teacher = _teacher(BertForTokenClassification, id2label={0: "O", 1: "B-PER", 2: "I-PER"})
    student = narrow(teacher, Basis(torch.eye(32), 1.0), layers=3).eval()
    ids = torch.randint(5, 60, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids=ids).logits, teacher(input_ids=ids).logits)
    assert student.config.num_attention_heads == 4
    assert student.config.intermediate_size == 48


def test_a_narrow_student_has_the_teachers_head_width_and_first_layers():
    teacher = _teacher(BertForPreTraining)
    q, _ = torch.linalg.qr(torch.randn(32, 32))
    student = narrow(teacher, Basis(q[:, :16], 0.7), layers=2)
    c = student.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (16, 2, 2)
    assert c.intermediate_size == 24  # the teacher's ratio to the width
    # the MLM decoder stays tied to the narrowed word embeddings
    assert student.cls.predictions.decoder.weight is student.bert.embeddings.word_embeddings.weight
    torch.testing.assert_close(
        student.bert.embeddings.word_embeddings.weight,
        teacher.bert.embeddings.word_embeddings.weight @ q[:, :16],
    )
    with pytest.raises(ValueError, match="multiple of the head width"):
        narrow(teacher, Basis(q[:, :12], 0.7), layers=2)
    with pytest.raises(ValueError, match="layers must be"):
        narrow(teacher, Basis(q[:, :16], 0.7), layers=4)


def test_the_basis_is_orthonormal_and_says_how_much_of_the_stream_it_keeps():
    torch.manual_seed(1)
    directions = torch.linalg.qr(torch.randn(8, 3))[0].T  # a stream living in 3 of 8 dims
    states = torch.randn(200, 3) * torch.tensor([5.0, 2.0, 1.0]) @ directions
    full = stream_basis(states, 3)
    assert full.energy == pytest.approx(1.0)
    torch.testing.assert_close(full.vectors.T @ full.vectors, torch.eye(3), atol=1e-5, rtol=0)
    two = stream_basis(states, 2)
    assert 0.8 < two.energy < 1.0
    assert torch.allclose((two.vectors.T @ directions[0]).norm(), torch.tensor(1.0), atol=1e-2)
    with pytest.raises(ValueError, match="width"):
        stream_basis(states, 9)


def test_it_keeps_the_heads_and_feed_forward_units_that_matter():
    teacher = _teacher()
    layer = teacher.bert.encoder.layer[0]
    with torch.no_grad():  # head 2 (of 4, 8 wide) and unit 5 made to dominate
        layer.attention.self.value.weight[16:24] *= 20
        layer.attention.output.dense.weight[:, 16:24] *= 20
        layer.intermediate.dense.weight[5] *= 50
        layer.output.dense.weight[:, 5] *= 50
    student = narrow(teacher, Basis(torch.eye(32)[:, :8], 0.5), layers=1)  # one head kept
    torch.testing.assert_close(
        student.bert.encoder.layer[0].attention.self.value.weight,
        layer.attention.self.value.weight[16:24, :8],
    )
    units = student.bert.encoder.layer[0].intermediate.dense.weight
    assert any(torch.equal(row, layer.intermediate.dense.weight[5, :8]) for row in units)


def test_the_stream_is_every_real_token_at_every_kept_layer(checkpoints):
    teacher = load_model(checkpoints["BertForPreTraining"]).eval()
    tok = BertTokenizer.load(checkpoints["BertForPreTraining"])
    texts = ["the film was good", "paris"]
    states = collect_states(teacher, tok, texts, layers=2)
    tokens = sum(len(e.input_ids) for e in tok.encode_batch(texts))
    assert states.shape == (tokens * 3, 32)  # embeddings + two layers, no padding


@pytest.mark.slow
def test_shrink_writes_a_student_with_the_teachers_tokenizer_and_provenance(checkpoints, tmp_path):
    out = tmp_path / "student"
    teacher = checkpoints["BertForPreTraining"]
    args = ["shrink", "--teacher", str(teacher), "--layers", "1", "--hidden", "16"]
    args += ["--intermediate", "12", "--data", str(WIKI), "--sentences", "64"]
    assert main([*args, "--out", str(out)]) == 0
    student = load_model(out)
    c = student.config
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (16, 1, 12)
    assert (out / "tokenizer.json").is_file()
    assert BertTokenizer.load(out).encode("the film").input_ids == (
        BertTokenizer.load(teacher).encode("the film").input_ids
    )
    summary = json.loads((out / "shrink.json").read_text())
    assert 0 < summary["energy_kept"] <= 1 and summary["sentences"] > 0
    assert json.loads((out / "source.json").read_text())["sha256"]


@pytest.mark.slow
def test_a_narrowed_student_distils_and_keeps_its_weights_provenance(checkpoints, tmp_path):
    """The command chain of `make student-init` + `make student`: the student, narrowed from a
    teacher checkpoint, learns the teacher's task and carries the root weights' provenance
    (source.json) into its run, from where the exporter writes it into bundle.json."""
    from tests.training.test_distil import fine_tuned_teacher

    teacher, common, _ = fine_tuned_teacher("classify", checkpoints, tmp_path, epochs=5)
    narrowed = tmp_path / "narrowed"
    args = ["shrink", "--teacher", str(teacher), "--layers", "1", "--hidden", "16"]
    assert main([*args, "--data", str(WIKI), "--sentences", "32", "--out", str(narrowed)]) == 0
    out = tmp_path / "student"
    args = ["distil", "--task", "classify", "--teacher", str(teacher), "--student", str(narrowed)]
    assert main([*args, "--out", str(out), *common]) == 0
    student = load_model(out)
    assert student.config.hidden_size == 16
    assert student.config.id2label == load_model(teacher).config.id2label
    assert json.loads((out / "source.json").read_text()) == json.loads(
        (narrowed / "source.json").read_text()
    )
