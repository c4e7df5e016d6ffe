"""Reranker training end to end on tiny data: the listwise loss falls, a stopped run resumes at
its step, and the checkpoint exports to a rerank bundle that evaluates through the service's
code."""

from __future__ import annotations

import json
import random

import pytest

from bertserve.export.bundle import build_bundle
from bertserve.model.checkpoint import read_config
from bertserve.model.training.__main__ import main
from bertserve.model.training.evaluate import evaluate

pytestmark = pytest.mark.slow
# Every question's gold paragraph is the king's, among the same four: learnable in a few steps
# by a tiny random model, which is all this test needs of it.
GOLD = "the king was born in paris"
OTHERS = ["the dog and the fox were in london", "a dull movie , a bad film", "the queen is here"]


def write_squad(root):
    rng = random.Random(0)
    articles = []
    for a in range(8):
        order = [GOLD, *OTHERS]
        rng.shuffle(order)
        paragraphs = [
            {
                "context": p,
                "qas": [{"id": f"{a}-{q}", "question": q, "answers": []} for q in QUESTIONS]
                if p == GOLD
                else [],
            }
            for p in order
        ]
        articles.append({"title": f"t{a}", "paragraphs": paragraphs})
    squad = root / "squad-v1.1"
    squad.mkdir()
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        (squad / name).write_text(json.dumps({"data": articles}))
    return squad


QUESTIONS = ["where was the king born ?", "who was born in paris ?"]


def test_rerank_trains_resumes_exports_and_evaluates(checkpoints, tmp_path, capsys):
    data = write_squad(tmp_path)
    recipe = tmp_path / "rerank.toml"
    recipe.write_text(
        "max_seq_len = 32\ngroups = 4\nnegatives = 3\nsteps = 40\nlr = 5e-3\neval_every = 20\n"
        "checkpoint_every = 10\nheld_out_articles = 2\neval_questions = 8\ncandidates = 4\n"
        "threads = 1\n"
    )
    out = tmp_path / "reranker"
    args = ["rerank", "--init", str(checkpoints["BertForPreTraining"]), "--data", str(data)]
    args += ["--out", str(out), "--recipe", str(recipe)]
    assert main([*args, "--stop-after", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 20
    assert main(args) == 0  # resumes at step 20
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 40
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps)) == list(range(10, 41, 10))  # none twice after the resume
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < 0.5 * losses[0]  # from ln 4 (no preference) down
    assert read_config(out).num_labels == 1

    spec = build_bundle(out, ["rerank"], tmp_path / "bundle")
    assert spec.tasks == ["rerank"]
    result = evaluate("rerank", tmp_path / "bundle", data)
    assert result["ranked_by"] == "cross-encoder (/rerank)" and result["questions"] == 16
    assert result["top1"] > 90  # the king's paragraph, now through the exported graph
