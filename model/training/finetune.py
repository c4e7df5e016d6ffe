"""Fine-tuning: SST-2 / TREC (classify), CoNLL-2003 (ner), SQuAD v1.1 (qa).

    bertserve finetune --task classify --init checkpoints/pretrained-wiki-tiny \
        --data DATA/sst2 --out runs/sst2 [--recipe finetune-sst2]

`--init random` trains the same shape from BERT's random initialisation: the no-pre-training
baseline. The best checkpoint on the dev metric (config.json with id2label, model.safetensors,
tokenizer.json) is written to OUT with metrics.jsonl and curves.png; training stops early after
`patience` evaluations without improvement.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bertserve.model.checkpoint import load_model, read_config, save_model
from bertserve.model.heads import BertPreTrainedModel
from bertserve.model.sources import resolve_init, write_provenance
from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.data import tasks as data
from bertserve.model.training.loop import (
    MetricsLog,
    build_optimizer,
    optimizer_step,
    plot_curves,
    warmup_linear_decay,
)
from bertserve.model.training.metrics import accuracy, entity_f1
from bertserve.model.training.recipe import FlatRecipe
from bertserve.runtime.encoding import CASE_OR_UNKNOWN, CASE_UNKNOWN, case_type_vocab

log = logging.getLogger(__name__)
HEAD = {
    "classify": "BertForSequenceClassification",
    "ner": "BertForTokenClassification",
    "qa": "BertForQuestionAnswering",
}


@dataclass(frozen=True)
class FinetuneRecipe(FlatRecipe):
    name: str
    task: str
    description: str = ""
    max_seq_len: int = 128
    batch_size: int = 32
    epochs: float = 3.0
    lr: float = 1e-4
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    dropout: float = 0.1
    length_buckets: int = 50  # batches drawn at random, sorted by length, then split (less padding)
    eval_every: int = 200  # optimizer steps
    patience: int = 5  # evaluations without a better dev metric
    train_fraction: float = 1.0  # share of the training examples kept (stated in the model card)
    dev_limit: int = 0  # dev examples scored during training (0 = all)
    doc_stride: int = 128  # qa windows
    seed: int = 1234
    threads: int = 0
    # ner: segment ids carry each piece's letter case (BertConfig.case_type_ids), for an
    # uncased vocabulary: 0 off, 1 (or true) case as written, 2 the same but a text without any
    # capital reads as "case unknown" (runtime/tasks/ner.py); the segment table grows to 5 or 6
    # rows, the new ones from row 0
    case_type_ids: int = 0
    # with case_type_ids: this share of training sentences is shown without its case (as text
    # written in lower case reaches /ner: scheme 1 all "no capital", scheme 2 all "unknown"),
    # drawn once with the seed, so the tagger does not depend on capitals it may not be given
    case_dropout: float = 0.0


# --- features -----------------------------------------------------------------------------------


@dataclass
class Features:
    """Unpadded training rows: ids, segment ids and the task's targets."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    targets: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.input_ids)

    def head(self, n: int) -> Features:
        return Features(
            self.input_ids[:n], self.token_type_ids[:n], {k: v[:n] for k, v in self.targets.items()}
        )


def build_features(
    task: str,
    tok: BertTokenizer,
    data_dir: Path,
    split: str,
    recipe: FinetuneRecipe,
    labels: list[str],
    fraction: float = 1.0,
    case_types: int = 0,
) -> tuple[Features, list[Any]]:
    """Features and the raw examples they came from; `fraction` keeps that share of the
    examples (drawn with the recipe's seed) before any tokenising; `case_types`: a tagging
    model's segment ids carry letter case (BertConfig.case_type_ids)."""
    label2id = {label: i for i, label in enumerate(labels)}

    def sample(examples: list[Any]) -> list[Any]:
        return data.subsample(examples, fraction, recipe.seed)

    if task == "classify":
        reader = data.read_trec if (data_dir / "train.txt").is_file() else data.read_sst2
        examples: list[Any] = sample(reader(data_dir, split))
        encodings = tok.encode_batch([e.text for e in examples], max_length=recipe.max_seq_len)
        return Features(
            [e.input_ids for e in encodings],
            [e.token_type_ids for e in encodings],
            {"labels": [label2id[e.label] for e in examples]},
        ), examples
    if task == "ner":
        examples = sample(data.read_conll(data_dir, split))
        ids, targets, types = zip(
            *(
                data.align_labels(tok, s.words, s.tags, label2id, recipe.max_seq_len, case_types)
                for s in examples
            ),
            strict=True,
        )
        return Features(list(ids), list(types), {"labels": list(targets)}), examples
    examples = sample(data.read_squad(data_dir, split, data.ambiguous_ids(data_dir, split)))
    feats = [
        f for e in examples for f in data.qa_features(tok, e, recipe.max_seq_len, recipe.doc_stride)
    ]
    return Features(
        [f.input_ids for f in feats],
        [f.token_type_ids for f in feats],
        {"start_positions": [f.start for f in feats], "end_positions": [f.end for f in feats]},
    ), examples


def drop_case(features: Features, share: float, seed: int, scheme: int = 1) -> int:
    """Show `share` of the rows (drawn with `seed`) without their letter case, as /ner sends
    text written in lower case: every segment id 0 (scheme 1), or every piece CASE_UNKNOWN
    between [CLS] and [SEP] (scheme 2). Returns how many."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"case_dropout must be in [0, 1], got {share}")
    rows = np.flatnonzero(np.random.default_rng(seed).random(len(features)) < share)
    for i in rows:
        n = len(features.token_type_ids[i])
        if scheme == CASE_OR_UNKNOWN:
            features.token_type_ids[i] = [0, *[CASE_UNKNOWN] * (n - 2), 0]
        else:
            features.token_type_ids[i] = [0] * n
    return len(rows)


def task_labels(task: str, data_dir: Path) -> list[str] | None:
    if task == "ner":
        return list(data.CONLL_LABELS)
    if task == "classify":
        if (data_dir / "train.txt").is_file():
            return sorted({e.label for e in data.read_trec(data_dir, "train")})
        return list(data.SST2_LABELS)
    return None


def batch_tensors(features: Features, rows: np.ndarray, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(features.input_ids[i]) for i in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    types = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    out: dict[str, torch.Tensor] = {}
    for j, i in enumerate(rows):
        length = len(features.input_ids[i])
        ids[j, :length] = torch.tensor(features.input_ids[i])
        types[j, :length] = torch.tensor(features.token_type_ids[i])
        mask[j, :length] = 1
    for name, values in features.targets.items():
        if isinstance(values[0], list):  # per-token labels
            t = torch.full((n, width), data.IGNORE, dtype=torch.long)
            for j, i in enumerate(rows):
                t[j, : len(values[i])] = torch.tensor(values[i])
            out[name] = t
        else:
            out[name] = torch.tensor([values[i] for i in rows])
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask} | out


def length_bucketed(
    features: Features,
    keep: list[int],
    batch_size: int,
    buckets: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """One epoch of full batches: a random permutation cut into chunks of `buckets` batches,
    each chunk sorted by length and split, and the batches shuffled. Rows of a batch then have
    similar lengths, so little compute goes to padding, while every batch still mixes examples
    from all over the data. `buckets` <= 1 is a plain random order."""
    order = rng.permutation(keep)
    chunk = batch_size * max(1, buckets)
    batches = []
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        if buckets > 1:
            part = part[np.argsort([len(features.input_ids[i]) for i in part], kind="stable")]
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    batches = [b for b in batches if len(b) == batch_size]
    return [batches[i] for i in rng.permutation(len(batches))]


# --- dev metric (torch, during training; the shipped numbers come from `evaluate`) ---------------


@torch.no_grad()
def dev_metric(
    task: str,
    model: BertPreTrainedModel,
    features: Features,
    labels: list[str] | None,
    pad_id: int,
) -> dict[str, float]:
    model.eval()
    order = np.arange(len(features))
    losses, predictions, golds = [], [], []
    for start in range(0, len(order), 64):
        rows = order[start : start + 64]
        batch = batch_tensors(features, rows, pad_id)
        out = model(**batch)
        losses.append(float(out.loss) * len(rows))
        if task == "classify":
            predictions.extend(out.logits.argmax(-1).tolist())
        elif task == "ner" and labels:  # at the labelled pieces: the words /ner reads
            for j, i in enumerate(rows):
                gold = features.targets["labels"][i]
                pred = out.logits[j].argmax(-1).tolist()
                golds.append([labels[g] for g in gold if g != data.IGNORE])
                predictions.append(
                    [labels[p] for p, g in zip(pred, gold, strict=False) if g != data.IGNORE]
                )
    model.train()
    result = {"dev_loss": sum(losses) / max(1, len(features))}
    if task == "classify":
        result["dev_metric"] = accuracy(features.targets["labels"], predictions)
    elif task == "ner":
        result["dev_metric"] = entity_f1(golds, predictions)["f1"]
    else:
        result["dev_metric"] = -result["dev_loss"]  # SQuAD EM/F1 comes from `evaluate`
    return result


# --- the loop -----------------------------------------------------------------------------------


def fit(
    model: torch.nn.Module,
    recipe: FinetuneRecipe,
    train: Features,
    loss_of: Callable[[np.ndarray, float], tuple[torch.Tensor, dict[str, float]]],
    evaluate: Callable[[], dict[str, float]],
    save: Callable[[], None],
    out: Path,
    title: str,
) -> tuple[float, int, int]:
    """The training loop fine-tuning and distillation share: length-bucketed batches of `train`,
    AdamW over `model`'s parameters with warm-up and linear decay, `loss_of(rows, progress)`
    (progress in [0, 1], for schedules such as the distillation temperature), an evaluation
    every `eval_every` steps that calls `save` on a new best, early stop after `patience`
    evaluations without one. Writes metrics.jsonl and curves.png to `out`; returns
    (best dev metric, steps, seconds)."""
    steps_per_epoch = max(1, len(train) // recipe.batch_size)
    total = max(1, int(steps_per_epoch * recipe.epochs))
    optimizer = build_optimizer(model, recipe.lr, recipe.weight_decay, (0.9, 0.999))
    scheduler = warmup_linear_decay(optimizer, max(1, int(recipe.warmup_fraction * total)), total)
    metrics = MetricsLog(out / "metrics.jsonl")
    metrics.path.write_text("")
    rng = np.random.default_rng(recipe.seed)
    best, stale, step = -float("inf"), 0, 0
    started = time.time()
    model.train()
    bar = tqdm(total=total, desc=title, dynamic_ncols=True)
    rows_all = list(range(len(train)))
    while step < total and stale < recipe.patience:
        for rows in length_bucketed(train, rows_all, recipe.batch_size, recipe.length_buckets, rng):
            loss, parts = loss_of(rows, step / total)
            optimizer_step(model, loss, optimizer, scheduler, recipe.clip)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % 20 == 0:
                record = {"step": step, "kind": "train", "loss": loss.item()}
                metrics.append(record | parts | {"lr": scheduler.get_last_lr()[0]})
            if step % recipe.eval_every == 0 or step == total:
                result = evaluate()
                model.train()
                metrics.append({"step": step, "kind": "eval", **result})
                if result["dev_metric"] > best:
                    best, stale = result["dev_metric"], 0
                    save()
                else:
                    stale += 1
                bar.write(f"step {step}: dev {result['dev_metric']:.2f} (best {best:.2f})")
            if step >= total or stale >= recipe.patience:
                break
    bar.close()
    plot_curves(metrics.read(), out / "curves.png", ["loss"], ["dev_metric"], title)
    return best, step, round(time.time() - started)


def start_run(task: str, recipe: FinetuneRecipe) -> None:
    """What every fine-tuning-like run does first: check the task, threads, the seed."""
    if task not in HEAD:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(HEAD)}")
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)


def case_overrides(task: str, recipe: FinetuneRecipe, source: Path) -> dict[str, Any]:
    """Config changes for a recipe whose segment ids carry letter case (case_type_ids)."""
    if not recipe.case_type_ids:
        return {}
    if task != "ner":
        raise ValueError(f"case_type_ids is for ner (a one-segment tagging input), not {task}")
    segments = read_config(source).type_vocab_size
    return {
        "case_type_ids": recipe.case_type_ids,
        "type_vocab_size": max(segments, case_type_vocab(recipe.case_type_ids)),
    }


def finetune(
    task: str,
    init: str,
    data_dir: Path,
    out: Path,
    recipe: FinetuneRecipe,
    tokenizer_dir: Path | None = None,
) -> dict[str, Any]:
    start_run(task, recipe)
    random_init = init == "random"
    provenance = None
    if random_init:
        if tokenizer_dir is None:
            raise ValueError(
                "--init random needs --tokenizer CHECKPOINT (its shape and vocabulary)"
            )
        source = tokenizer_dir
    else:
        source, provenance = resolve_init(init)
    tok = BertTokenizer.load(source)
    labels = task_labels(task, data_dir)
    overrides: dict[str, Any] = {
        "hidden_dropout_prob": recipe.dropout,
        "attention_probs_dropout_prob": recipe.dropout,
    }
    if labels:
        overrides["id2label"] = dict(enumerate(labels))
        overrides["label2id"] = None
    overrides |= case_overrides(task, recipe, source)
    model = load_model(source, HEAD[task], weights=not random_init, **overrides)
    cased = model.config.case_type_ids
    if recipe.case_dropout and not cased:
        raise ValueError("case_dropout needs case_type_ids")
    # Subsample examples (questions, sentences), not windows, and before tokenising: 87k SQuAD
    # questions take minutes to window.
    train, _ = build_features(
        task, tok, data_dir, "train", recipe, labels or [], recipe.train_fraction, cased
    )
    if recipe.case_dropout:
        drop_case(train, recipe.case_dropout, recipe.seed, cased)
    dev, _ = build_features(task, tok, data_dir, "dev", recipe, labels or [], case_types=cased)
    if recipe.dev_limit:  # the first rows
        dev = dev.head(recipe.dev_limit)

    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.json").write_text(
        json.dumps(
            dataclasses.asdict(recipe) | {"init": init, "train_examples": len(train)}, indent=2
        )
    )
    if provenance is not None:
        write_provenance(out, provenance)

    def loss_of(rows: np.ndarray, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        return model(**batch_tensors(train, rows, tok.pad_id)).loss, {}

    def save() -> None:
        save_model(model, out)
        tok.save(out)

    best, step, seconds = fit(
        model,
        recipe,
        train,
        loss_of,
        lambda: dev_metric(task, model, dev, labels, tok.pad_id),
        save,
        out,
        f"{task} ({recipe.name}, init {'random' if random_init else 'pre-trained'})",
    )
    summary = {
        "task": task,
        "best_dev_metric": best,
        "steps": step,
        "seconds": seconds,
        "train_examples": len(train),
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
