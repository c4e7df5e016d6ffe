"""Pre-training with MLM + NSP: corpus -> vocabulary -> NSP pairs -> the training loop.

`bertserve pretrain --recipe cpu --data DIR --out OUT` runs it all. Prepared data
(tokenizer and pair shards) lands in OUT/data and is reused when the recipe's data settings are
unchanged; OUT/checkpoint is rewritten every `checkpoint_every` steps and a run started again with
the same OUT resumes from it exactly (same batches, masks, dropout and schedule). The finished
model (config.json, model.safetensors, tokenizer.json), its held-out evaluation (eval.json), the
metrics log and the loss-curve plot are written to OUT.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bertserve.model.checkpoint import load_model
from bertserve.model.config import BertConfig
from bertserve.model.heads import BertForPreTraining
from bertserve.model.sources import resolve_init, write_provenance
from bertserve.model.tokenizer import BertTokenizer
from bertserve.model.training.data.pretraining import (
    MaskingConfig,
    PairShard,
    pairs_from_document,
    write_pairs,
)
from bertserve.model.training.data.tasks import read_conll_documents
from bertserve.model.training.data.wikipedia import is_heldout, read_documents
from bertserve.model.training.loop import (
    Dist,
    MetricsLog,
    build_optimizer,
    load_training_state,
    plot_curves,
    save_training_state,
    unwrap,
    warmup_linear_decay,
)
from bertserve.model.training.recipe import Recipe

log = logging.getLogger(__name__)


# --- data ---------------------------------------------------------------------------------------


def prepare_data(recipe: Recipe, data_dir: Path, out: Path, news_dir: Path | None = None) -> None:
    """Train the vocabulary on the training documents and write train/heldout pair shards; with
    `news_copies`, CoNLL-2003's training stories (in `news_dir`) join the training pairs. The
    held-out pairs stay Wikipedia's, so figures compare across recipes."""
    settings = recipe.data
    if settings.news_copies and news_dir is None:
        raise ValueError(
            f"recipe {recipe.name!r} mixes in news (news_copies {settings.news_copies}): "
            "give --news DIR, the CoNLL-2003 directory"
        )
    stamp = out / "settings.json"
    wanted = json.dumps(
        recipe.to_dict()["data"]
        | {"seed": recipe.train.seed, "init": recipe.init}
        | ({"news": str(news_dir)} if settings.news_copies else {}),
        sort_keys=True,
    )
    if stamp.is_file() and stamp.read_text() == wanted:
        log.info("reusing prepared data in %s", out)
        return
    started = time.time()
    docs = list(read_documents(data_dir, settings.max_docs or None))
    heldout = [d for d in docs if is_heldout(d.id, settings.heldout_fraction)]
    train = [d for d in docs if not is_heldout(d.id, settings.heldout_fraction)]
    if not train or not heldout:
        raise ValueError(f"{len(docs)} documents give {len(train)} train / {len(heldout)} held out")
    log.info("%d documents: %d train, %d held out", len(docs), len(train), len(heldout))

    if recipe.init:  # the checkpoint's own vocabulary: its embeddings are indexed by it
        tokenizer = BertTokenizer.load(resolve_init(recipe.init)[0])
    else:
        tokenizer = BertTokenizer.train(
            texts=(s for d in train for s in d.sentences),
            vocab_size=settings.vocab_size,
            lowercase=settings.lowercase,
        )
    tokenizer.save(out)
    rng = random.Random(recipe.train.seed)
    news_rng = random.Random(f"{recipe.train.seed}-news")

    def cut(tokenised: list[list[list[int]]], dupes: int, draw: random.Random = rng) -> list[Any]:
        return [
            pair
            for _ in range(dupes)
            for i in range(len(tokenised))
            for pair in pairs_from_document(
                tokenised,
                i,
                settings.max_seq_len,
                settings.short_seq_prob,
                draw,
                settings.sentence_pair_prob,
            )
        ]

    for name, split, dupes in (("train", train, settings.dupe_factor), ("heldout", heldout, 1)):
        pairs = cut(_tokenise(tokenizer, [d.sentences for d in split]), dupes)
        if name == "train":
            rng.shuffle(pairs)
        if name == "train" and settings.news_copies:
            assert news_dir is not None  # checked above
            stories = read_conll_documents(news_dir, "train")
            # Cut and mixed in with a generator of their own: `rng` draws what it draws without
            # news, so the held-out pairs, cut next, are the same as such a run's.
            news = cut(_tokenise(tokenizer, stories), settings.news_copies, news_rng)
            log.info("news: %d stories, %d pairs", len(stories), len(news))
            pairs += news
            news_rng.shuffle(pairs)
        write_pairs(pairs, out / name, tokenizer.vocab_size)
        log.info(
            "%s: %d pairs, %d tokens", name, len(pairs), sum(len(p.a) + len(p.b) for p in pairs)
        )
    stamp.write_text(wanted)
    log.info("data prepared in %.0f s", time.time() - started)


def _tokenise(tokenizer: BertTokenizer, docs: list[list[str]]) -> list[list[list[int]]]:
    """Each document (its sentences) as lists of word-piece ids; empty ones dropped."""
    sentences = [s for d in docs for s in d]
    # The raw `tokenizers` batch call: ids only, no per-token Python objects (1.4 M sentences).
    ids = [e.ids for e in tokenizer.tokenizer.encode_batch(sentences, add_special_tokens=False)]
    out, start = [], 0
    for d in docs:
        count = len(d)
        doc = [s for s in ids[start : start + count] if s]
        start += count
        if doc:
            out.append(doc)
    return out


def masking_for(tokenizer: BertTokenizer, recipe: Recipe) -> MaskingConfig:
    return MaskingConfig(
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        mask_id=tokenizer.mask_id,
        pad_id=tokenizer.pad_id,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=recipe.data.max_seq_len,
        max_predictions=recipe.data.max_predictions,
    )


def model_config(recipe: Recipe, tokenizer: BertTokenizer) -> BertConfig:
    return BertConfig(
        vocab_size=tokenizer.vocab_size,
        pad_token_id=tokenizer.pad_id,
        **recipe.model.__dict__,
    )


def build_model(
    recipe: Recipe, tokenizer: BertTokenizer, out: Path | None = None
) -> BertForPreTraining:
    """The model to pre-train: BERT's random initialisation in the recipe's shape, or (with
    `init`) the checkpoint's encoder and pooler under new MLM/NSP heads where it has none, with
    `frozen_layers` frozen. The provenance of `init` is written to `out`."""
    if not recipe.init:
        return BertForPreTraining(model_config(recipe, tokenizer))
    source, provenance = resolve_init(recipe.init)
    model = load_model(
        source,
        BertForPreTraining.architecture,
        hidden_dropout_prob=recipe.model.hidden_dropout_prob,
        attention_probs_dropout_prob=recipe.model.attention_probs_dropout_prob,
    )
    assert isinstance(model, BertForPreTraining)  # the head asked for
    if model.config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"{recipe.init}: {model.config.vocab_size} embeddings for a vocabulary of "
            f"{tokenizer.vocab_size}; prepared data from another tokenizer? (remove OUT/data)"
        )
    freeze(model, recipe.train.frozen_layers)
    if out is not None:
        write_provenance(out, provenance)
    return model


def pretraining_model(model: torch.nn.Module) -> BertForPreTraining:
    """The model under a DistributedDataParallel wrapper, if any."""
    inner = unwrap(model)
    assert isinstance(inner, BertForPreTraining)
    return inner


def freeze(model: BertForPreTraining, layers: int) -> None:
    """No gradients for the embeddings (and so the tied MLM decoder) and the first `layers`
    encoder layers; 0 freezes nothing."""
    if layers <= 0:
        return
    encoder = model.bert.encoder.layer
    if layers > len(encoder):
        raise ValueError(f"frozen_layers {layers}: the model has {len(encoder)} layers")
    for module in (model.bert.embeddings, *encoder[:layers]):
        for parameter in module.parameters():
            parameter.requires_grad_(False)


# --- evaluation ---------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: BertForPreTraining, shard: PairShard, pairs: int, batch_size: int, device: torch.device
) -> dict[str, float]:
    """MLM accuracy at the selected positions and NSP accuracy on held-out pairs (fixed masks)."""
    was_training = model.training
    model.eval()
    rows = list(range(min(pairs, len(shard))))
    mlm_hits = mlm_total = nsp_hits = 0
    mlm_loss = nsp_loss = 0.0
    for start in range(0, len(rows), batch_size):
        batch = to_tensors(shard.batch(rows[start : start + batch_size], seed=0, epoch=0), device)
        out = model(**batch)
        labels = batch["mlm_labels"]
        selected = labels != -100
        mlm_hits += int((out.mlm_logits.argmax(-1)[selected] == labels[selected]).sum())
        mlm_total += int(selected.sum())
        nsp_hits += int((out.nsp_logits.argmax(-1) == batch["next_sentence_label"]).sum())
        n = len(batch["next_sentence_label"])
        mlm_loss += float(out.mlm_loss) * n
        nsp_loss += float(out.nsp_loss) * n
    model.train(was_training)
    return {
        "mlm_accuracy": mlm_hits / max(1, mlm_total),
        "nsp_accuracy": nsp_hits / max(1, len(rows)),
        "mlm_loss": mlm_loss / max(1, len(rows)),
        "nsp_loss": nsp_loss / max(1, len(rows)),
        "pairs": len(rows),
    }


def to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in batch.items()}


# --- training -----------------------------------------------------------------------------------


def step_rows(
    order_for_epoch, steps_per_epoch: int, step: int, micro: int, recipe: Recipe, d: Dist
) -> tuple[int, np.ndarray]:
    """The pair indices of one micro-batch. Each optimizer step consumes
    micro_batch x accumulation x world pairs; micro-batch m of rank r takes slot (m * world + r),
    so one process accumulating k micro-batches sees the same pairs as k processes."""
    t = recipe.train
    epoch, in_epoch = divmod(step, steps_per_epoch)
    global_batch = t.micro_batch * t.accumulation * d.world
    slot = micro * d.world + d.rank
    start = in_epoch * global_batch + slot * t.micro_batch
    return epoch, order_for_epoch(epoch)[start : start + t.micro_batch]


def pretrain(
    recipe: Recipe,
    data_dir: Path,
    out: Path,
    stop_after: int | None = None,
    news_dir: Path | None = None,
) -> dict[str, float] | None:
    """Run (or resume) the recipe. `stop_after` ends the process after that many optimizer steps
    in total, leaving a checkpoint to resume from; returns the final evaluation when finished.
    `news_dir`: CoNLL-2003's directory, for a recipe that mixes in news (`news_copies`)."""
    d = Dist.setup()
    t = recipe.train
    if t.threads and d.device.type == "cpu":
        torch.set_num_threads(t.threads)
    out.mkdir(parents=True, exist_ok=True)
    if d.main:
        prepare_data(recipe, data_dir, out / "data", news_dir)
        (out / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2))
    d.barrier()

    tokenizer = BertTokenizer.load(out / "data")
    masking = masking_for(tokenizer, recipe)
    train_shard = PairShard(out / "data" / "train", masking)
    heldout = PairShard(out / "data" / "heldout", masking)
    global_batch = t.micro_batch * t.accumulation * d.world
    steps_per_epoch = len(train_shard) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(train_shard)} training pairs cannot fill one batch of {global_batch}"
        )

    torch.manual_seed(t.seed)
    model: torch.nn.Module = build_model(recipe, tokenizer, out if d.main else None).to(d.device)
    optimizer = build_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2))
    scheduler = warmup_linear_decay(
        optimizer, max(1, int(t.warmup_fraction * t.max_steps)), t.max_steps
    )
    metrics = MetricsLog(out / "metrics.jsonl")
    checkpoint = out / "checkpoint"
    step = 0
    if (checkpoint / "trainer_state.pt").is_file():
        step, _ = load_training_state(checkpoint, model, optimizer, scheduler)
        log.info("resumed from %s at step %d", checkpoint, step)
    if d.main:
        metrics.truncate_after(step)
    if d.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    model.train()

    orders: dict[int, np.ndarray] = {}

    def order_for_epoch(epoch: int) -> np.ndarray:
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([t.seed, epoch]).permutation(len(train_shard))
        return orders[epoch]

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=d.device.type == "cuda")
    last = t.max_steps if stop_after is None else min(t.max_steps, stop_after)
    bar = tqdm(
        total=t.max_steps,
        initial=step,
        disable=not d.main,
        dynamic_ncols=True,
        desc=f"pretrain {recipe.name}",
    )
    window_tokens, window_start = 0, time.time()
    while step < last:
        sums = {"loss": 0.0, "mlm_loss": 0.0, "nsp_loss": 0.0}
        for micro in range(t.accumulation):
            epoch, rows = step_rows(order_for_epoch, steps_per_epoch, step, micro, recipe, d)
            batch = to_tensors(train_shard.batch(rows, t.seed, epoch), d.device)
            window_tokens += int(batch["attention_mask"].sum()) * d.world
            sync = micro == t.accumulation - 1 or d.world == 1
            # no_sync is DistributedDataParallel's (model is wrapped whenever sync can be false)
            context = model.no_sync() if not sync else contextlib.nullcontext()  # type: ignore[operator]
            with context, autocast:
                result = model(**batch)
                (result.loss / t.accumulation).backward()
            for key in sums:
                sums[key] += float(getattr(result, key).detach()) / t.accumulation
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)

        if step % t.log_every == 0 or step == last:
            loss, mlm, nsp = d.mean([sums["loss"], sums["mlm_loss"], sums["nsp_loss"]])
            elapsed = time.time() - window_start
            tokens_per_s = window_tokens / max(elapsed, 1e-9)
            window_tokens, window_start = 0, time.time()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            if d.main:
                metrics.append(
                    {
                        "step": step,
                        "kind": "train",
                        "loss": loss,
                        "mlm_loss": mlm,
                        "nsp_loss": nsp,
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": grad_norm,
                        "tokens_per_s": tokens_per_s,
                        "epoch": epoch,
                    }
                )
        if step % t.eval_every == 0 or step == t.max_steps:
            if d.main:
                result_eval = evaluate(
                    pretraining_model(model),
                    heldout,
                    recipe.data.eval_pairs,
                    t.micro_batch,
                    d.device,
                )
                metrics.append({"step": step, "kind": "eval", **result_eval})
                bar.write(
                    f"step {step}: held-out MLM accuracy {result_eval['mlm_accuracy']:.3f}, "
                    f"NSP accuracy {result_eval['nsp_accuracy']:.3f}"
                )
            d.barrier()
        if step % t.checkpoint_every == 0 or step == last:
            if d.main:
                save_training_state(checkpoint, model, optimizer, scheduler, step)
            d.barrier()
    bar.close()

    final = None
    if step >= t.max_steps and d.main:
        final = finish(recipe, pretraining_model(model), tokenizer, heldout, metrics, out, d)
    d.barrier()
    d.close()
    return final


def finish(
    recipe: Recipe,
    model: BertForPreTraining,
    tokenizer: BertTokenizer,
    heldout: PairShard,
    metrics: MetricsLog,
    out: Path,
    d: Dist,
) -> dict[str, float]:
    """Write the servable result: the checkpoint, tokenizer, evaluation and loss curves."""
    from bertserve.model.checkpoint import save_model

    save_model(model, out)
    tokenizer.save(out)
    pairs = recipe.data.final_eval_pairs or len(heldout)
    result = evaluate(model, heldout, pairs, recipe.train.micro_batch, d.device)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_curves(
        metrics.read(),
        out / "curves.png",
        ["loss", "mlm_loss", "nsp_loss"],
        ["mlm_accuracy", "nsp_accuracy"],
        f"pre-training ({recipe.name})",
    )
    return result
