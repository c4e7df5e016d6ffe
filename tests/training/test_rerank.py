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


def write_squad(root, gold=GOLD, answers=(), name="squad-v1.1"):
    """Eight articles of the same four paragraphs, the questions asked of `gold`'s."""
    rng = random.Random(0)
    articles = []
    marked = [{"text": a, "answer_start": 0} for a in answers]
    for a in range(8):
        order = [GOLD, *OTHERS]
        rng.shuffle(order)
        paragraphs = [
            {
                "context": p,
                "qas": [{"id": f"{a}-{q}", "question": q, "answers": marked} for q in QUESTIONS]
                if p == gold
                else [],
            }
            for p in order
        ]
        articles.append({"title": f"t{a}", "paragraphs": paragraphs})
    squad = root / name
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
    assert result["top1_holds_answer"] == result["top1"]  # no answers marked in this data
    # The same questions marked as the queen's, with an answer only the king's paragraph holds:
    # ranked first, it is wrong by SQuAD's mark and right by what it holds.
    marked = write_squad(tmp_path, gold=OTHERS[2], answers=["paris"], name="marked")
    result = evaluate("rerank", tmp_path / "bundle", marked)
    assert result["top1"] < 10 and result["top1_holds_answer"] > 90


def test_an_answer_is_held_as_whole_words_normalised_as_squad_scores():
    from bertserve.model.training.rerank import holds_answer

    assert holds_answer("The game was at Levi's Stadium in Santa Clara.", ("Levi's Stadium.",))
    assert holds_answer("He wore RED.", ("nothing", "red"))
    assert not holds_answer("It was covered in snow.", ("red",))  # not inside a word
    assert not holds_answer("It cost 1200 dollars.", ("12",))
    assert not holds_answer("Anything at all.", ("the",))  # nothing left once normalised


def test_mined_negatives_are_the_models_own_highest_ranked_without_answers(checkpoints):
    """`mine` keeps, for each question, the paragraphs the model itself scores highest among
    those drawn, best first, and never one that holds an answer (it may answer the question)."""
    import torch

    from bertserve.model.checkpoint import load_model
    from bertserve.model.tokenizer import BertTokenizer
    from bertserve.model.training.rerank import HEAD, Encoder, Question, RerankRecipe, mine, scores

    source = checkpoints["BertForPreTraining"]
    model = load_model(source, HEAD, id2label={0: "relevance"}, label2id=None).eval()
    answer = "the king was born in paris , they say"  # holds the answer: never a negative
    articles = [[GOLD, *OTHERS, answer, "a dull film in london", "the fox is a dog"]]
    questions = [Question(q, 0, 0, ("Paris",)) for q in QUESTIONS]
    others = [i for i in range(1, len(articles[0])) if articles[0][i] != answer]

    def score(q, paragraphs):
        with torch.no_grad():
            s = scores(model, encode([(q.text, articles[0][i]) for i in paragraphs]))
        return dict(zip(paragraphs, s.tolist(), strict=True))

    # A pool as large as the article: the model's two best of all the others.
    recipe = RerankRecipe(name="t", max_seq_len=32, mined_negatives=2, mine_pool=10)
    encode = Encoder(BertTokenizer.load(source), recipe)
    for q, negatives in zip(
        questions, mine(model, encode, questions, articles, recipe), strict=True
    ):
        s = score(q, others)
        assert negatives == sorted(others, key=lambda i: -s[i])[:2]
    # A smaller pool: two of a draw of three, best first, never the gold or the answer's.
    recipe = RerankRecipe(name="t", max_seq_len=32, mined_negatives=2, mine_pool=3)
    picks = mine(model, encode, questions * 10, articles, recipe)
    for q, negatives in zip(questions * 10, picks, strict=True):
        s = score(q, others)
        assert len(set(negatives)) == len(negatives) <= 2 and set(negatives) <= set(others)
        assert negatives == sorted(negatives, key=lambda i: -s[i])
    assert len({tuple(n) for n in picks}) > 1  # the draw varies: not always the global best


def test_a_group_puts_the_mined_first_and_fills_without_answers():
    import numpy as np

    from bertserve.model.training.rerank import Question, candidates, group_paragraphs

    articles = [[f"paragraph {i}" for i in range(10)] + ["it was in paris"]]
    q = Question("where ?", 4, 0, ("Paris",))
    plain = group_paragraphs(q, articles, 5, np.random.default_rng(3))
    assert plain == candidates(q, articles, 6, np.random.default_rng(3))  # unchanged without
    for seed in range(20):
        group = group_paragraphs(q, articles, 5, np.random.default_rng(seed), mined=[7, 2])
        assert group[:3] == [4, 7, 2] and len(group) <= 6
        assert len(set(group)) == len(group) and 10 not in group  # no repeat, no answer
    assert group_paragraphs(q, articles, 2, np.random.default_rng(0), mined=[7, 2, 9]) == [4, 7, 2]


def test_mined_run_reuses_its_mining_and_uses_it_in_order(
    checkpoints, tmp_path, capsys, monkeypatch
):
    """With mined negatives the run mines once, before its first step, into OUT/mined.json, and
    each step's questions get their own mined negatives; a resumed run reads the file back; a
    changed setting with a trained model in OUT/last is refused before anything is written
    (mining again would use the trained model, not the starting one)."""
    from bertserve.model.training import rerank

    used = []
    group_paragraphs = rerank.group_paragraphs

    def recording(q, articles, negatives, rng, mined=None):
        used.append(mined)
        return group_paragraphs(q, articles, negatives, rng, mined)

    monkeypatch.setattr(rerank, "group_paragraphs", recording)
    data = write_squad(tmp_path)
    body = (
        "max_seq_len = 32\ngroups = 2\nnegatives = 3\nmined_negatives = 2\nmine_pool = 3\n"
        "steps = 6\nlr = 5e-3\neval_every = 3\ncheckpoint_every = 3\nheld_out_articles = 2\n"
        "eval_questions = 4\ncandidates = 4\nthreads = 1\n"
    )
    recipe = tmp_path / "mined.toml"
    recipe.write_text(body)
    out = tmp_path / "mined"
    args = ["rerank", "--init", str(checkpoints["BertForPreTraining"]), "--data", str(data)]
    args += ["--out", str(out), "--recipe", str(recipe)]
    assert main([*args, "--stop-after", "3"]) == 0
    capsys.readouterr()
    mined = json.loads((out / "mined.json").read_text())
    assert len(mined["negatives"]) == 6 * 2  # every question the run will visit
    assert all(len(n) == 2 for n in mined["negatives"])  # 3 others, none holds an answer here
    assert used == mined["negatives"][:6]  # steps 1-3, two questions each, in order
    stamp = (out / "mined.json").stat().st_mtime_ns
    assert main(args) == 0  # resumes at step 3 with the same negatives
    assert json.loads(capsys.readouterr().out)["steps"] == 6
    assert (out / "mined.json").stat().st_mtime_ns == stamp
    assert used == mined["negatives"]
    written = (out / "recipe.json").read_text()
    recipe.write_text(body.replace("mine_pool = 3", "mine_pool = 2"))
    assert main(args) == 2
    assert "mined with other settings" in capsys.readouterr().err
    assert (out / "recipe.json").read_text() == written


@pytest.mark.parametrize(("selection", "saved_after"), [("top1", [1]), ("top1+mrr10", [1, 2])])
def test_selection_keeps_the_start_unless_beaten(
    checkpoints, tmp_path, monkeypatch, capsys, selection, saved_after
):
    """The evaluations read (top-1, MRR@10) = (50, 0.6) at the start, (50, 0.7) at step 3 and
    (50, 0.65) at step 6: by top-1 alone the starting model stays the best; with MRR@10 as the
    tie-break, step 3's replaces it and step 6's does not."""
    from bertserve.model.training import rerank

    script = iter([(50.0, 0.6), (50.0, 0.7), (50.0, 0.65)])
    evaluated, saves = [], []

    def scripted(*args, **kwargs):
        top1, mrr = next(script)
        evaluated.append(top1)
        return {"top1": top1, "mrr10": mrr}

    monkeypatch.setattr(rerank, "ranking_metrics", scripted)
    monkeypatch.setattr(rerank, "save_model", lambda model, out: saves.append(len(evaluated)))
    data = write_squad(tmp_path)
    recipe = tmp_path / "select.toml"
    recipe.write_text(
        "max_seq_len = 32\ngroups = 2\nnegatives = 3\nsteps = 6\neval_every = 3\n"
        f"held_out_articles = 2\neval_at_start = true\nselection = '{selection}'\nthreads = 1\n"
    )
    args = ["rerank", "--init", str(checkpoints["BertForPreTraining"]), "--data", str(data)]
    assert main([*args, "--out", str(tmp_path / "out"), "--recipe", str(recipe)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(evaluated) == 3 and saves == saved_after
    assert summary["best_held_out_mrr10"] == (0.6 if selection == "top1" else 0.7)


@pytest.mark.parametrize(
    ("setting", "message"),
    [("selection = 'mrr'", "selection is 'top1' or 'top1+mrr10'"), ("mined_negatives = 4", "0..")],
)
def test_a_recipe_it_cannot_follow_is_refused_in_one_line(tmp_path, capsys, setting, message):
    data = write_squad(tmp_path)
    recipe = tmp_path / "bad.toml"
    recipe.write_text(f"negatives = 3\n{setting}\n")
    args = ["rerank", "--init", str(tmp_path / "none"), "--data", str(data)]
    assert main([*args, "--out", str(tmp_path / "out"), "--recipe", str(recipe)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is loaded or written
