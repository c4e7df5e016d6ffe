"""The pre-training loop on the tiny recipe: it learns, resumes exactly, DDP equals one process."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bertserve.model.checkpoint import load_model
from bertserve.model.training.__main__ import main
from bertserve.model.training.recipe import RECIPES_DIR, Recipe

FIXTURE = Path(__file__).parents[1] / "fixtures" / "wiki"
pytestmark = pytest.mark.slow


def train_losses(out: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


def write_recipe(path: Path, **train) -> Path:
    data = tomllib.loads((RECIPES_DIR / "tiny.toml").read_text())
    data["train"].update(train)
    # No dropout: each process draws its own dropout masks, one process draws them in sequence.
    data["model"].update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    lines = [f'description = "{data["description"]}"']
    for section in ("model", "data", "train"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in data[section].items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full")
    assert main(["pretrain", "--recipe", "tiny", "--data", str(FIXTURE), "--out", str(out)]) == 0
    return out


def test_run_writes_a_loadable_model_with_its_evaluation(uninterrupted):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "eval.json",
        "curves.png",
        "recipe.json",
    ):
        assert (uninterrupted / name).is_file(), name
    model = load_model(uninterrupted)
    assert type(model).__name__ == "BertForPreTraining"
    result = json.loads((uninterrupted / "eval.json").read_text())
    # Held out, after 12 steps: both heads beat guessing (a uniform MLM over the 300-piece
    # vocabulary has loss ln 300 = 5.70; a coin for NSP ln 2 = 0.69). Measured: 5.63, 0.66.
    assert result["mlm_loss"] < math.log(300) and result["nsp_loss"] < math.log(2)
    assert result["pairs"] >= 20
    losses = [loss for _, loss, _ in train_losses(uninterrupted)]
    assert len(losses) == Recipe.load("tiny").train.max_steps
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns


def test_interrupted_and_resumed_run_gives_the_same_curve(tmp_path, uninterrupted):
    # Share the prepared data: the `tokenizers` WordPiece trainer breaks frequency ties in hash
    # order, so two vocabulary trainings can differ in marginal pieces; the loop must not.
    shutil.copytree(uninterrupted / "data", tmp_path / "data")
    args = ["pretrain", "--recipe", "tiny", "--data", str(FIXTURE), "--out", str(tmp_path)]
    assert main([*args, "--stop-after", "5"]) == 0  # checkpoint_every = 3: resumes from step 5
    assert not (tmp_path / "model.safetensors").exists()
    assert len(train_losses(tmp_path)) == 5
    assert main(args) == 0
    assert train_losses(tmp_path) == train_losses(uninterrupted)


def test_two_process_torchrun_matches_one_process_accumulating(tmp_path):
    """Two gloo processes with one micro-batch each see the pairs one process sees accumulating
    two micro-batches: the same losses and gradient norms, step by step."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    main(
        [
            "pretrain",
            "--recipe",
            "tiny",
            "--data",
            str(FIXTURE),
            "--out",
            str(single),
            "--stop-after",
            "0",
        ]
    )
    shutil.copytree(single / "data", ddp / "data")
    main(
        [
            "pretrain",
            "--recipe",
            str(write_recipe(tmp_path / "acc2.toml", accumulation=2, max_steps=4, micro_batch=4)),
            "--data",
            str(FIXTURE),
            "--out",
            str(single),
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "model.training",
            "pretrain",
            "--recipe",
            str(write_recipe(tmp_path / "acc1.toml", accumulation=1, max_steps=4, micro_batch=4)),
            "--data",
            str(FIXTURE),
            "--out",
            str(ddp),
        ],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    one, two = train_losses(single), train_losses(ddp)
    assert [s for s, _, _ in one] == [s for s, _, _ in two] == [1, 2, 3, 4]
    for (_, loss_1, norm_1), (_, loss_2, norm_2) in zip(one, two, strict=True):
        assert loss_1 == pytest.approx(loss_2, rel=1e-5)
        assert norm_1 == pytest.approx(norm_2, rel=1e-4)


def test_continued_pretraining_starts_from_the_checkpoint_and_keeps_frozen_layers(
    tmp_path, uninterrupted
):
    """`init` = a checkpoint: its vocabulary (no new one trained), its weights; the embeddings
    (so the tied decoder) and the first `frozen_layers` stay exactly as they were, the rest
    trains; the provenance of the start is written beside the result."""
    import torch

    from bertserve.model.sources import read_provenance
    from bertserve.model.tokenizer import BertTokenizer

    recipe = write_recipe(tmp_path / "continue.toml", frozen_layers=1, max_steps=6)
    recipe.write_text(f'init = "{uninterrupted}"\n' + recipe.read_text())
    out = tmp_path / "continued"
    assert (
        main(["pretrain", "--recipe", str(recipe), "--data", str(FIXTURE), "--out", str(out)]) == 0
    )
    before = load_model(uninterrupted).state_dict()
    after = load_model(out).state_dict()
    frozen = [k for k in before if k.startswith(("bert.embeddings.", "bert.encoder.layer.0."))]
    trained = [k for k in before if k.startswith("bert.encoder.layer.1.")]
    assert frozen and trained
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in trained if k.endswith("weight"))
    start = BertTokenizer.load(uninterrupted).tokenizer.get_vocab()
    assert BertTokenizer.load(out / "data").tokenizer.get_vocab() == start
    provenance = read_provenance(out)
    assert provenance is not None and provenance.to_dict()["sha256"]
    assert json.loads((out / "recipe.json").read_text())["init"] == str(uninterrupted)


def test_news_stories_join_the_training_pairs_and_leave_the_held_out_ones(tmp_path, checkpoints):
    """`news_copies`: CoNLL-2003's training stories are cut into pairs (that many passes) and
    shuffled in with Wikipedia's; the held-out pairs stay Wikipedia's alone, so figures compare
    with a run without news. A recipe asking for news without `--news` says what to give."""
    import dataclasses

    import numpy as np

    from bertserve.model.tokenizer import BertTokenizer
    from bertserve.model.training.data.pretraining import PairShard
    from bertserve.model.training.pretrain import masking_for, prepare_data
    from tests.training.test_news_eval import STORIES, write_news

    news = write_news(tmp_path / "conll2003", STORIES * 4, split="eng.train")
    # A checkpoint's vocabulary, as continued training has (a vocabulary trained here can differ
    # from one training to the next)
    plain = dataclasses.replace(Recipe.load("tiny"), init=str(checkpoints["BertForPreTraining"]))
    mixed = dataclasses.replace(plain, data=dataclasses.replace(plain.data, news_copies=2))
    with pytest.raises(ValueError, match="give --news DIR"):
        prepare_data(mixed, FIXTURE, tmp_path / "refused")
    shards = {}
    for name, recipe, news_dir in (("plain", plain, None), ("mixed", mixed, news)):
        prepare_data(recipe, FIXTURE, tmp_path / name, news_dir)
        masking = masking_for(BertTokenizer.load(tmp_path / name), recipe)
        shards[name] = {s: PairShard(tmp_path / name / s, masking) for s in ("train", "heldout")}
    added = len(shards["mixed"]["train"]) - len(shards["plain"]["train"])
    assert added >= 2 * len(STORIES * 4)  # at least a pair a story each pass
    for field in ("index", "tokens"):
        np.testing.assert_array_equal(
            getattr(shards["mixed"]["heldout"], field), getattr(shards["plain"]["heldout"], field)
        )
    settings = json.loads((tmp_path / "mixed" / "settings.json").read_text())
    assert settings["news"] == str(news) and settings["news_copies"] == 2
