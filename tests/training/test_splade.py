"""SPLADE training end to end on tiny data (the ranking loss falls, a stopped run resumes at its
step, the checkpoint exports to a sparse bundle), and the retrieval evaluation through a real
server's /embed, /embed_sparse and /rerank; its fusion and metrics on hand-made rankings."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from bertserve.export.bundle import build_bundle
from bertserve.model.training.__main__ import main
from bertserve.model.training.evaluate import evaluate
from bertserve.model.training.retrieval import fuse, metrics, rankings
from tests.helpers.checkpoints import cross_encoder
from tests.helpers.server import live_server

NOUNS = ["king", "queen", "dog", "fox", "film", "movie", "city", "river"]
PLACES = ["paris", "france", "london"]


def write_squad(root):
    """24 paragraphs, each of its own two words; each question asks for its paragraph's two."""
    articles = []
    for a, (noun, place) in enumerate(itertools.product(NOUNS, PLACES)):
        qas = [{"id": f"{a}", "question": f"where is the {noun} of {place} ?", "answers": []}]
        context = f"the {noun} was born in {place} in the first year ."
        articles.append({"title": f"t{a}", "paragraphs": [{"context": context, "qas": qas}]})
    squad = root / "squad-v1.1"
    squad.mkdir()
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        (squad / name).write_text(json.dumps({"data": articles}))
    return squad


def test_fusion_and_metrics_by_hand():
    a = np.asarray([[3, 1, 2], [0, 1, 2]])
    b = np.asarray([[1, 3, 0], [2, 1, 0]])
    # row 0: 1 and 3 are first and second (a tie, broken by id), 2 third and absent;
    # row 1: 0 and 2 first and third (1/61 + 1/63) beat 1 second twice (2/62)
    assert fuse(a, b).tolist() == [[1, 3, 0, 2], [0, 2, 1]] or fuse(a, b)[:, :3].tolist() == [
        [1, 3, 0],
        [0, 2, 1],
    ]
    ranked = np.asarray([[5, 0, *range(6, 14)], [1, *range(2, 11)], [*range(20, 30)]])
    assert metrics(ranked, np.asarray([0, 1, 2])) == {
        "recall1": round(1 / 3, 4),
        "recall10": round(2 / 3, 4),
        "mrr10": round((0.5 + 1) / 3, 4),
    }
    scores = np.asarray([[0.1, 0.9, 0.5], [0.3, 0.3, 0.2]])
    assert rankings(scores, 2).tolist() == [[1, 2], [0, 1]]  # ties in column order


@pytest.mark.slow
def test_splade_trains_resumes_exports_and_evaluates_through_http(checkpoints, tmp_path, capsys):
    data = write_squad(tmp_path)
    recipe = tmp_path / "splade.toml"
    recipe.write_text(
        "max_query_len = 16\nmax_doc_len = 24\nbatch = 8\nsteps = 30\nlr = 3e-3\n"
        "eval_every = 15\ncheckpoint_every = 5\nheld_out_articles = 4\neval_questions = 4\n"
        "init_doc_nonzero = 20\nthreads = 1\n"
    )
    out = tmp_path / "splade"
    args = ["splade", "--init", str(checkpoints["BertForPreTraining"]), "--data", str(data)]
    args += ["--out", str(out), "--recipe", str(recipe)]
    assert main([*args, "--stop-after", "15"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 15
    assert main(args) == 0  # resumes at step 15
    assert json.loads(capsys.readouterr().out)["steps"] == 30
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps)) == list(range(5, 31, 5))  # none twice after the resume
    init = [r for r in records if r["kind"] == "init"]
    assert len(init) == 1 and init[0]["bias_shift"] != 0  # lowered once, not again on resume
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert np.mean(losses[-2:]) < 0.7 * losses[0]
    mined = json.loads((out / "mined.json").read_text())["negatives"]
    assert len(mined) == 30 * 8 and all(len(m) <= 1 for m in mined)

    bundles = tmp_path / "bundles"
    build_bundle(out, ["sparse"], bundles / "splade")
    build_bundle(checkpoints["BertForPreTraining"], ["embed"], bundles / "dense")
    build_bundle(cross_encoder(tmp_path / "cross"), ["rerank"], bundles / "cross")
    with live_server(bundles=bundles, max_wait_ms=5) as live:
        result = evaluate("retrieval", None, data, url=live.url, rerank_questions=6)
    for name in ("bm25", "dense", "sparse", "hybrid_dense_sparse", "hybrid_dense_bm25"):
        assert set(result[name]) == {"recall1", "recall10", "mrr10"}
        assert 0 <= result[name]["recall1"] <= result[name]["recall10"] <= 1
    assert result["bm25"]["recall1"] == 1.0  # each question names its paragraph's two words
    assert result["hybrid_dense_sparse_reranked"]["questions"] == 6
    assert result["data"] == "SQuAD v1.1 dev: 24 questions, 24 paragraphs"
    assert result["sparse_nonzero"]["paragraph"] > 0


def test_retrieval_needs_a_url(tmp_path):
    with pytest.raises(ValueError, match="--url"):
        evaluate("retrieval", None, tmp_path)
