"""Fit a pre-trained model's NSP head (pooler + classifier) to single-sentence pairs, the
encoder, the embeddings and the MLM head unchanged.

    python -m model.training nsp-head --checkpoint runs/pretrain-minilm \
        --data DATA/wikipedia-en-2015/text --out runs/minilm-wiki-mlm

Pre-training builds each NSP example from multi-sentence segments filling up to 128 tokens;
`/nsp` is asked about two sentences. The head sees a different [CLS] there: the continued
MiniLM run scored 94.7% on its own held-out segments and 89.2% on held-out sentence pairs. This
stage draws sentence pairs the way `evaluate --task nsp` does (half the next sentence, half a
sentence of another document), from the training documents only (the held-out hash split is the
evaluation's), runs the frozen encoder over them once, and fits the pooler and the classifier on
the cached [CLS] states with AdamW: minutes, not hours. Everything else in the checkpoint is
copied unchanged, so `/fill-mask` answers exactly as before.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.checkpoint import load_model, save_model
from model.heads import BertForPreTraining
from model.tokenizer import BertTokenizer
from model.training.data.wikipedia import is_heldout, read_documents

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NspHeadRecipe:
    pairs: int = 20_000  # training pairs (half true continuations)
    dev_pairs: int = 2_000  # from other training documents: picks the best epoch
    heldout_fraction: float = 0.02  # the pre-training's and the evaluation's split
    max_docs: int = 20_000
    max_seq_len: int = 128
    encode_batch: int = 64
    epochs: int = 20
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 1234
    threads: int = 2


def sentence_pairs(
    docs: list[list[str]], n: int, rng: random.Random
) -> tuple[list[tuple[str, str]], list[int]]:
    """n pairs, alternately (sentence i, sentence i+1) with label 0 (is next) and (sentence i, a
    sentence of another document) with label 1, as `evaluate --task nsp` draws them."""
    pairs, labels = [], []
    for k in range(n):
        doc = rng.randrange(len(docs))
        i = rng.randrange(len(docs[doc]) - 1)
        if k % 2 == 0:
            pairs.append((docs[doc][i], docs[doc][i + 1]))
            labels.append(0)
        else:
            other = rng.randrange(len(docs) - 1)
            other += other >= doc  # any document but this one
            pairs.append((docs[doc][i], rng.choice(docs[other])))
            labels.append(1)
    return pairs, labels


@torch.no_grad()
def cls_states(
    model: BertForPreTraining,
    tokenizer: BertTokenizer,
    pairs: list[tuple[str, str]],
    recipe: NspHeadRecipe,
    desc: str,
) -> torch.Tensor:
    """The encoder's last hidden state at [CLS] for each pair (length-sorted batches)."""
    model.eval()
    encodings = tokenizer.encode_batch(
        [a for a, _ in pairs], [b for _, b in pairs], max_length=recipe.max_seq_len
    )
    order = sorted(range(len(pairs)), key=lambda i: len(encodings[i].input_ids))
    out = torch.zeros(len(pairs), model.config.hidden_size)
    for start in tqdm(range(0, len(order), recipe.encode_batch), desc=desc, dynamic_ncols=True):
        rows = order[start : start + recipe.encode_batch]
        width = max(len(encodings[i].input_ids) for i in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            enc = encodings[i]
            ids[j, : len(enc.input_ids)] = torch.tensor(enc.input_ids)
            types[j, : len(enc.input_ids)] = torch.tensor(enc.token_type_ids)
            mask[j, : len(enc.input_ids)] = 1
        sequence, _ = model.bert(ids, mask, types)
        out[rows] = sequence[:, 0]
    return out


def head_logits(model: BertForPreTraining, cls: torch.Tensor) -> torch.Tensor:
    return model.cls.seq_relationship(model.bert.pooler(cls[:, None, :]))


def fit_nsp_head(
    checkpoint: Path, data_dir: Path, out: Path, recipe: NspHeadRecipe
) -> dict[str, Any]:
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    started = time.time()
    model = load_model(checkpoint, "BertForPreTraining")
    assert isinstance(model, BertForPreTraining)
    tokenizer = BertTokenizer.load(checkpoint)
    docs = [
        d.sentences
        for d in read_documents(data_dir, recipe.max_docs)
        if not is_heldout(d.id, recipe.heldout_fraction) and len(d.sentences) >= 4
    ]
    if len(docs) < 4:
        raise ValueError(f"{data_dir}: {len(docs)} training documents of 4+ sentences")
    rng = random.Random(recipe.seed)
    rng.shuffle(docs)
    split = max(2, len(docs) // 10)  # dev pairs from documents the training pairs never see
    train_pairs, train_labels = sentence_pairs(docs[split:], recipe.pairs, rng)
    dev_pairs, dev_labels = sentence_pairs(docs[:split], recipe.dev_pairs, rng)
    train_x = cls_states(model, tokenizer, train_pairs, recipe, "encoder, training pairs")
    dev_x = cls_states(model, tokenizer, dev_pairs, recipe, "encoder, dev pairs")
    train_y, dev_y = torch.tensor(train_labels), torch.tensor(dev_labels)

    params = [*model.bert.pooler.parameters(), *model.cls.seq_relationship.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)

    def dev_accuracy() -> float:
        with torch.no_grad():
            return float((head_logits(model, dev_x).argmax(-1) == dev_y).float().mean() * 100)

    before = dev_accuracy()
    best, best_state, history = before, None, []
    gen = torch.Generator().manual_seed(recipe.seed)
    for epoch in range(recipe.epochs):
        order = torch.randperm(len(train_x), generator=gen)
        for start in range(0, len(order), recipe.batch_size):
            rows = order[start : start + recipe.batch_size]
            loss = F.cross_entropy(head_logits(model, train_x[rows]), train_y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        acc = dev_accuracy()
        history.append({"epoch": epoch + 1, "dev_accuracy": acc, "loss": float(loss)})
        if acc > best:
            best = acc
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
    if best_state is not None:
        model.load_state_dict(best_state)
    model.tie_weights()

    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    tokenizer.save(out)
    for name in ("source.json",):  # provenance of the starting weights travels on
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)
    summary = {
        "checkpoint": str(checkpoint),
        "recipe": asdict(recipe),
        "training_documents": len(docs) - split,
        "dev_documents": split,
        "dev_accuracy_before": before,
        "dev_accuracy": best,
        "history": history,
        "seconds": round(time.time() - started),
    }
    (out / "nsp_head.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("NSP head: dev accuracy %.2f -> %.2f", before, best)
    return summary


def unchanged_outside_head(a: BertForPreTraining, b: BertForPreTraining) -> bool:
    """True when two models differ at most in the pooler and the NSP classifier."""
    sa, sb = a.state_dict(), b.state_dict()
    head = ("bert.pooler.", "cls.seq_relationship.")
    return (
        all(torch.equal(sa[k], sb[k]) for k in sa if not k.startswith(head))
        and sa.keys() == sb.keys()
    )
