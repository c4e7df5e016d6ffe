"""SPLADE training: a sparse retriever (the MLM head at every position, log(1 + ReLU) and the max
over the text's tokens: model/heads.py `splade_pool`) fine-tuned from an MLM checkpoint on SQuAD
v1.1 *train* (question -> paragraph).

Each step takes `batch` questions. Each brings its gold paragraph and `hard_negatives` paragraphs
that BM25 (`bm25s`, over every train paragraph) ranks highest for it but that hold none of its
answers (mined once, before the first step, into `OUT/mined.json`); every question is scored
against every paragraph of the step by the dot product of the sparse vectors (in-batch
negatives), and the loss is the softmax cross-entropy of its own paragraph among them
(sentence-transformers' SparseMultipleNegativesRankingLoss), plus the FLOPS regulariser of each
side (the squared mean weight of each vocabulary entry over the batch, summed: what keeps the
vectors sparse), its weight rising quadratically over the first `flops_warmup_fraction` of the
steps, as SPLADE's schedule does.

The last `held_out_articles` train articles are kept out: their questions, each retrieved among
all those articles' paragraphs, pick the best checkpoint by recall@1 (ties by MRR@10). SQuAD dev
stays untouched for the evaluation through the service (`bertserve evaluate --task retrieval`).

    bertserve splade --init runs/minilm-wiki-mlm --data DATA/squad-v1.1 \
        --out runs/splade-minilm [--recipe splade-squad-minilm] [--stop-after N]

Resumable: `OUT/last/` holds the model, optimizer, schedule and step every `checkpoint_every`
steps; the same command continues from it. `OUT` holds the best checkpoint, a BertForMaskedLM
that `bertserve export --task sparse` reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from bertserve.model.checkpoint import load_model, save_model
from bertserve.model.heads import splade_pool
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
from bertserve.model.training.recipe import FlatRecipe
from bertserve.model.training.rerank import Question, holds_answer, read_articles

log = logging.getLogger(__name__)
HEAD = "BertForMaskedLM"


@dataclass(frozen=True)
class SpladeRecipe(FlatRecipe):
    name: str
    description: str = ""
    max_query_len: int = 32
    max_doc_len: int = 192  # pieces of a paragraph, special tokens included
    batch: int = 16  # questions a step
    hard_negatives: int = 1  # BM25-mined paragraphs a question, beside its gold one
    mine_depth: int = 10  # BM25 results looked at for them
    steps: int = 1000
    lr: float = 5e-5
    warmup_fraction: float = 0.05
    weight_decay: float = 0.01
    clip: float = 1.0
    dropout: float = 0.1
    query_flops: float = 5e-4  # FLOPS regulariser weights, reached after the warm-up below
    doc_flops: float = 3e-4
    flops_warmup_fraction: float = 0.3
    eval_every: int = 200
    checkpoint_every: int = 25
    held_out_articles: int = 20
    eval_questions: int = 500
    # The MLM head's bias lowered so that a paragraph starts with about this many non-zero
    # weights (`start_sparse`); 0 leaves it as the checkpoint has it.
    init_doc_nonzero: int = 256
    eval_at_start: bool = True  # the starting model is a candidate too (and the baseline)
    seed: int = 1234
    threads: int = 0


class Mining(Protocol):
    """What BM25 mining reads of a recipe (SPLADE's and ColBERT's)."""

    @property
    def hard_negatives(self) -> int: ...
    @property
    def mine_depth(self) -> int: ...


def encode(
    model: torch.nn.Module, tok: BertTokenizer, texts: list[str], max_len: int
) -> torch.Tensor:
    """(N, V) SPLADE vectors of `texts`, each cut to `max_len` pieces."""
    encoded = tok.encode_batch(texts, max_length=max_len, truncation="longest_first")
    width = max(len(e.input_ids) for e in encoded)
    ids = torch.full((len(encoded), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[i, : len(e.input_ids)] = 1
    logits = model(ids, mask, torch.zeros_like(ids)).logits  # (N, S, V)
    return splade_pool(logits, mask)


@torch.no_grad()
def start_sparse(
    model: Any, tok: BertTokenizer, paragraphs: list[str], recipe: SpladeRecipe
) -> float:
    """Lower the MLM head's output bias by one constant so that a paragraph's vector starts with
    about `init_doc_nonzero` non-zero weights (the median over 32 paragraphs); returns the
    shift. An MLM head's logits need not be negative for the words a text does not hold: the
    shipped minilm-wiki-mlm's max over a paragraph's positions is above zero for ~30,400 of its
    30,522 entries, a vector no regulariser sparsifies within a CPU budget (AdamW moves the
    bias ~lr a step)."""
    if not recipe.init_doc_nonzero:
        return 0.0
    model.eval()
    texts = paragraphs[:: max(1, len(paragraphs) // 32)][:32]
    encoded = tok.encode_batch(texts, max_length=recipe.max_doc_len)
    cuts = []
    for e in encoded:
        ids = torch.tensor([e.input_ids])
        top = model(ids, torch.ones_like(ids), torch.zeros_like(ids)).logits[0].max(0).values
        cuts.append(float(torch.topk(top, recipe.init_doc_nonzero).values[-1]))
    shift = float(np.median(cuts))
    model.cls.predictions.bias.sub_(shift)
    model.train()
    return shift


def flops(vectors: torch.Tensor) -> torch.Tensor:
    """SPLADE's FLOPS regulariser: the squared mean weight of each entry, summed."""
    return (vectors.mean(0) ** 2).sum()


def bm25_negatives(
    paragraphs: list[str], questions: list[Question], gold: list[int], recipe: Mining
) -> list[list[int]]:
    """For each question, BM25's best paragraphs (indices into `paragraphs`) that are not its
    own and hold none of its answers, at most `hard_negatives`."""
    import bm25s

    retriever = bm25s.BM25()
    tokens = bm25s.tokenize(paragraphs, stopwords="en", show_progress=False)
    retriever.index(tokens, show_progress=False)
    found, _ = retriever.retrieve(
        bm25s.tokenize([q.text for q in questions], stopwords="en", show_progress=False),
        k=min(recipe.mine_depth, len(paragraphs)),
        show_progress=False,
    )
    out = []
    for q, own, ranked in zip(questions, gold, found.tolist(), strict=True):
        picked = [int(p) for p in ranked if p != own and not holds_answer(paragraphs[p], q.answers)]
        out.append(picked[: recipe.hard_negatives])
    return out


@torch.no_grad()
def retrieval_metrics(
    model: torch.nn.Module,
    tok: BertTokenizer,
    questions: list[Question],
    paragraphs: list[str],
    gold: list[int],
    recipe: SpladeRecipe,
) -> dict[str, float]:
    """Recall@1, recall@10 and MRR@10 of each question's paragraph among all `paragraphs`, and
    the mean non-zero weights of a question's and a paragraph's vector."""
    model.eval()
    docs = torch.cat(
        [
            encode(model, tok, paragraphs[i : i + 32], recipe.max_doc_len)
            for i in range(0, len(paragraphs), 32)
        ]
    )
    queries = torch.cat(
        [
            encode(model, tok, [q.text for q in questions[i : i + 64]], recipe.max_query_len)
            for i in range(0, len(questions), 64)
        ]
    )
    scores = queries @ docs.T  # (Q, P)
    own = scores[torch.arange(len(gold)), torch.tensor(gold)]
    rank = (scores > own[:, None]).sum(1) + 1  # a tie counts for the gold paragraph
    return {
        "recall1": float((rank == 1).float().mean()),
        "recall10": float((rank <= 10).float().mean()),
        "mrr10": float(torch.where(rank <= 10, 1.0 / rank, 0.0).mean()),
        "query_nonzero": float((queries > 0).sum(1).float().mean()),
        "doc_nonzero": float((docs > 0).sum(1).float().mean()),
    }


def corpus(
    articles: list[list[str]], first: int, last: int
) -> tuple[list[str], dict[tuple[int, int], int]]:
    """The paragraphs of articles first..last-1 in one list, and (article, i) -> its index."""
    paragraphs: list[str] = []
    index: dict[tuple[int, int], int] = {}
    for a in range(first, last):
        for i, p in enumerate(articles[a]):
            index[(a, i)] = len(paragraphs)
            paragraphs.append(p)
    return paragraphs, index


def mined_negatives(
    paragraphs: list[str],
    visits: list[Question],
    gold: list[int],
    recipe: Mining,
    out: Path,
) -> list[list[int]]:
    """The hard negatives of each visited question: from `OUT/mined.json` when a run with the
    same settings wrote it, else mined now (BM25 does not change as the model trains)."""
    path = out / "mined.json"
    visited = hashlib.sha256(json.dumps([q.text for q in visits]).encode()).hexdigest()
    settings = {"visited": visited, "hard_negatives": recipe.hard_negatives}
    settings["mine_depth"] = recipe.mine_depth
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["settings"] == settings:
            return [list(m) for m in saved["negatives"]]
    negatives = bm25_negatives(paragraphs, visits, gold, recipe)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"settings": settings, "negatives": negatives}) + "\n")
    partial.replace(path)
    return negatives


def train_splade(
    init: str, data_dir: Path, out: Path, recipe: SpladeRecipe, stop_after: int | None = None
) -> dict[str, float | int]:
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    source, provenance = resolve_init(init)
    tok = BertTokenizer.load(source)
    model = load_model(
        source,
        HEAD,
        hidden_dropout_prob=recipe.dropout,
        attention_probs_dropout_prob=recipe.dropout,
    )
    articles, questions = read_articles(data_dir / "train-v1.1.json")
    cut = len(articles) - recipe.held_out_articles
    paragraphs, index = corpus(articles, 0, cut)
    held_paragraphs, held_index = corpus(articles, cut, len(articles))
    train = [q for q in questions if q.article < cut]
    held = [q for q in questions if q.article >= cut]
    held = [held[i] for i in np.random.default_rng(0).permutation(len(held))][
        : recipe.eval_questions
    ]
    held_gold = [held_index[(q.article, q.gold)] for q in held]
    order = np.random.default_rng(recipe.seed).permutation(len(train))
    visits = [train[order[k % len(train)]] for k in range(recipe.steps * recipe.batch)]
    gold = [index[(q.article, q.gold)] for q in visits]
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    mined = mined_negatives(paragraphs, visits, gold, recipe, out)
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
    step, best = 0, (-1.0, -1.0)
    if (last / "trainer_state.pt").is_file():
        step, extra = load_training_state(last, model, optimizer, scheduler)
        best = (float(extra.get("best", -1.0)), float(extra.get("best_mrr", -1.0)))
        metrics.truncate_after(step)
        log.info("resumed at step %d (best recall@1 %.3f)", step, best[0])
    else:
        metrics.path.write_text("")
        shift = start_sparse(model, tok, paragraphs, recipe)
        metrics.append({"step": 0, "kind": "init", "bias_shift": shift})
        log.info("MLM bias lowered by %.3f (init_doc_nonzero %d)", shift, recipe.init_doc_nonzero)

    def select(step: int) -> None:
        nonlocal best
        result = retrieval_metrics(model, tok, held, held_paragraphs, held_gold, recipe)
        model.train()
        metrics.append({"step": step, "kind": "eval", **result})
        if (result["recall1"], result["mrr10"]) > best:
            best = (result["recall1"], result["mrr10"])
            save_model(model, out)
            tok.save(out)
        tqdm.write(
            f"step {step}: held-out R@1 {result['recall1']:.3f} R@10 {result['recall10']:.3f} "
            f"MRR@10 {result['mrr10']:.4f}, non-zero q {result['query_nonzero']:.0f} "
            f"d {result['doc_nonzero']:.0f} (best R@1 {best[0]:.3f})",
            file=sys.stderr,
        )

    if step == 0 and recipe.eval_at_start:
        select(0)
    end = recipe.steps if stop_after is None else min(recipe.steps, stop_after)
    bar = tqdm(total=recipe.steps, initial=step, desc=f"splade ({recipe.name})", dynamic_ncols=True)
    ramp = max(1, int(recipe.flops_warmup_fraction * recipe.steps))
    model.train()
    while step < end:
        at = slice(step * recipe.batch, (step + 1) * recipe.batch)
        qs = visits[at]
        docs = gold[at] + [n for m in mined[at] for n in m]  # question i's own paragraph is i
        q = encode(model, tok, [x.text for x in qs], recipe.max_query_len)
        d = encode(model, tok, [paragraphs[i] for i in docs], recipe.max_doc_len)
        scores = q @ d.T  # (B, B + negatives)
        # A paragraph that is another question's own (two questions of one paragraph) is no
        # negative for it.
        same = torch.tensor([[gold[at][i] == p for p in docs] for i in range(len(qs))])
        same.fill_diagonal_(False)
        rank_loss = F.cross_entropy(scores.masked_fill(same, -1e4), torch.arange(len(qs)))
        weight = min(1.0, (step + 1) / ramp) ** 2
        reg = weight * (recipe.query_flops * flops(q) + recipe.doc_flops * flops(d))
        loss = rank_loss + reg
        optimizer_step(model, loss, optimizer, scheduler, recipe.clip)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{rank_loss.item():.3f}", reg=f"{reg.item():.3f}")
        if step % 5 == 0:
            metrics.append(
                {
                    "step": step,
                    "kind": "train",
                    "loss": rank_loss.item(),
                    "flops": reg.item(),
                    "query_nonzero": float((q > 0).sum(1).float().mean()),
                    "doc_nonzero": float((d > 0).sum(1).float().mean()),
                }
            )
        if step % recipe.eval_every == 0 or step in (recipe.steps, end):
            select(step)
        if step % recipe.checkpoint_every == 0 or step == end:
            save_training_state(
                last, model, optimizer, scheduler, step, {"best": best[0], "best_mrr": best[1]}
            )
    bar.close()
    plot_curves(
        metrics.read(), out / "curves.png", ["loss"], ["recall1"], f"splade ({recipe.name})"
    )
    summary = {
        "best_held_out_recall1": best[0],
        "best_held_out_mrr10": best[1],
        "steps": step,
        "seconds_this_run": round(time.time() - started),
        "train_questions": len(train),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
