"""Knowledge distillation: a fine-tuned teacher (all-MiniLM-L6-v2, 6 x 384) teaches a small
student of our architecture a task: a teacher's first layers narrowed (2 x 192, 3 x 192:
`model/training/shrink.py`, the teacher's vocabulary), or our own from-scratch pre-trained
2 x 128 model (its own cased vocabulary).

    bertserve distil --task classify --teacher runs/minilm-sst2 \
        --student runs/minilm-2x192 --data DATA/sst2 --out runs/distil-sst2

The classic recipe (Hinton et al.; hints as in FitNets / TinyBERT):

    loss = hard_weight * CE(student, gold)
         + soft_weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))
         + hint_weight * MSE(W_j h_student[j], h_teacher[m(j)])   at aligned positions

with the temperature T lowered linearly from `temperature_start` (3) to `temperature_end` over
training and hard:soft = 1:3. Student layer j (1-based) learns from teacher layer
m(j) = j * L_teacher / L_student through a linear map W_j (dropped after training).

Teacher and student may tokenise differently (uncased 30k vs cased 16k WordPiece), so soft targets
and hints are compared at positions that mean the same thing in both: [CLS], and the first piece
of each word (both pre-tokenisers split words alike; for QA, words are matched by character
offset, and answer ends at each word's last piece). Classification compares whole-sequence
logits; NER the label distribution of each word; QA the start (end) distribution over the
context's words. QA keeps the questions whose context fits one window for both tokenisers.

The teacher is a fine-tuned checkpoint, or a shipped bundle (a directory with `bundle.json`):
then ONNX Runtime computes its logits, once a training row (they are cached: the teacher is
frozen), and the hints are off, since a bundle's graph gives no hidden states.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertserve.model.checkpoint import load_model, save_model
from bertserve.model.config import BertConfig
from bertserve.model.heads import BertPreTrainedModel
from bertserve.model.sources import read_provenance, write_provenance
from bertserve.model.tokenizer import BertTokenizer, Encoding
from bertserve.model.training.data import tasks as data
from bertserve.model.training.finetune import (
    HEAD,
    Features,
    FinetuneRecipe,
    batch_tensors,
    build_features,
    case_overrides,
    dev_metric,
    drop_case,
    fit,
    start_run,
    task_labels,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistilRecipe(FinetuneRecipe):
    temperature_start: float = 3.0
    temperature_end: float = 1.0
    hard_weight: float = 0.25
    soft_weight: float = 0.75
    hint_weight: float = 1.0  # 0 switches the intermediate-layer hints off
    teacher_max_seq_len: int = 0  # 0 = max_seq_len


# --- losses -------------------------------------------------------------------------------------


def temperature(recipe: DistilRecipe, progress: float) -> float:
    """Linear from temperature_start at progress 0 to temperature_end at 1."""
    t0, t1 = recipe.temperature_start, recipe.temperature_end
    return t0 + (t1 - t0) * min(1.0, max(0.0, progress))


def soft_loss(student: Tensor, teacher: Tensor, t: float) -> Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the rows of the
    last axis' distributions. The T^2 keeps its gradients on the scale of the hard loss."""
    student = student.reshape(-1, student.shape[-1])
    teacher = teacher.reshape(-1, teacher.shape[-1])
    return (
        F.kl_div(
            F.log_softmax(student / t, dim=-1),
            F.log_softmax(teacher / t, dim=-1),
            reduction="batchmean",
            log_target=True,
        )
        * t
        * t
    )


def layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """Teacher layer (0-based) that each student layer learns from: uniform, ending on the
    last (2 of 6 -> layers 3 and 6, 0-based 2 and 5)."""
    return [(j + 1) * teacher_layers // student_layers - 1 for j in range(student_layers)]


class LayerOutputs:
    """Forward hooks that keep each encoder layer's output (B, S, H) of the last forward."""

    def __init__(self, model: BertPreTrainedModel) -> None:
        self.outputs: list[Tensor] = []
        bert: Any = model.bert  # every head's model has one
        layers = bert.encoder.layer
        self.handles = [layer.register_forward_hook(self._keep) for layer in layers]

    def _keep(self, module: nn.Module, args: Any, output: Tensor) -> None:
        self.outputs.append(output)

    def take(self) -> list[Tensor]:
        out, self.outputs = self.outputs, []
        return out


# --- paired features: the same examples through both tokenisers ---------------------------------


@dataclass
class Paired:
    student: Features
    teacher: Features
    starts: list[np.ndarray]  # (k, 2) [student position, teacher position]: [CLS], word starts
    ends: list[np.ndarray]  # QA only: (k, 2) positions of the same words' last pieces


def _labelled(labels: list[int]) -> list[int]:
    return [i for i, label in enumerate(labels) if label != data.IGNORE]


def _word_positions(enc: Encoding) -> tuple[dict[int, int], dict[int, int]]:
    """Context word starts and ends of one window: {char offset: token position}."""
    context = [i for i, s in enumerate(enc.sequence_ids) if s == 1]
    starts, ends = {}, {}
    for k, i in enumerate(context):
        if not enc.tokens[i].startswith("##"):
            starts[enc.offsets[i][0]] = i
        last = k + 1 == len(context) or not enc.tokens[context[k + 1]].startswith("##")
        if last:
            ends[enc.offsets[i][1]] = i
    return starts, ends


def _pairs(a: dict[int, int], b: dict[int, int], cls: bool) -> np.ndarray:
    shared = sorted(set(a) & set(b))
    rows = ([[0, 0]] if cls else []) + [[a[c], b[c]] for c in shared]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


def paired_features(
    task: str,
    student_tok: BertTokenizer,
    teacher_tok: BertTokenizer,
    data_dir: Path,
    recipe: DistilRecipe,
    labels: list[str],
    teacher_cased: int = 0,
    student_cased: int = 0,
) -> tuple[Paired, dict[str, int]]:
    """Training rows for both models, row i the same example, and the aligned positions
    (`teacher_cased`, `student_cased`: that model's segment ids carry letter case; the
    recipe's case_dropout then shows the same sentences to both without their case)."""
    teacher_len = recipe.teacher_max_seq_len or recipe.max_seq_len
    teacher_recipe = dataclasses.replace(recipe, max_seq_len=teacher_len)
    if task in ("classify", "ner"):
        student, examples = build_features(
            task,
            student_tok,
            data_dir,
            "train",
            recipe,
            labels,
            recipe.train_fraction,
            student_cased,
        )
        teacher, _ = build_features(
            task,
            teacher_tok,
            data_dir,
            "train",
            teacher_recipe,
            labels,
            recipe.train_fraction,
            teacher_cased,
        )
        if recipe.case_dropout:
            drop_case(student, recipe.case_dropout, recipe.seed, student_cased)
            if teacher_cased:  # the same rows: drop_case draws them from the seed alone
                drop_case(teacher, recipe.case_dropout, recipe.seed, teacher_cased)
        if task == "classify":
            starts = [np.zeros((1, 2), dtype=np.int64)] * len(student)
        else:  # the k-th labelled piece is the k-th word's first piece in both
            starts = []
            for s, t in zip(student.targets["labels"], teacher.targets["labels"], strict=True):
                s_pos, t_pos = _labelled(s), _labelled(t)
                k = min(len(s_pos), len(t_pos))
                pairs = [[0, 0], *zip(s_pos[:k], t_pos[:k], strict=True)]
                starts.append(np.asarray(pairs, dtype=np.int64))
        return Paired(student, teacher, starts, []), {"examples": len(examples)}

    examples = data.subsample(
        data.read_squad(data_dir, "train", data.ambiguous_ids(data_dir, "train")),
        recipe.train_fraction,
        recipe.seed,
    )
    s_rows: dict[str, list[Any]] = {"ids": [], "types": [], "start": [], "end": []}
    t_rows: dict[str, list[Any]] = {"ids": [], "types": []}
    starts, ends = [], []
    for example in examples:
        s_enc = data.qa_single_window(student_tok, example, recipe.max_seq_len)
        t_enc = data.qa_single_window(teacher_tok, example, teacher_len)
        if s_enc is None or t_enc is None:
            continue
        s_words, t_words = _word_positions(s_enc.encoding), _word_positions(t_enc.encoding)
        s_rows["ids"].append(s_enc.encoding.input_ids)
        s_rows["types"].append(s_enc.encoding.token_type_ids)
        s_rows["start"].append(s_enc.start)
        s_rows["end"].append(s_enc.end)
        t_rows["ids"].append(t_enc.encoding.input_ids)
        t_rows["types"].append(t_enc.encoding.token_type_ids)
        starts.append(_pairs(s_words[0], t_words[0], cls=True))
        ends.append(_pairs(s_words[1], t_words[1], cls=False))
    student = Features(
        s_rows["ids"],
        s_rows["types"],
        {"start_positions": s_rows["start"], "end_positions": s_rows["end"]},
    )
    teacher = Features(t_rows["ids"], t_rows["types"], {})
    kept = {"examples": len(examples), "single_window": len(student)}
    return Paired(student, teacher, starts, ends), kept


# --- the loss of one batch ----------------------------------------------------------------------


class Distiller(nn.Module):
    """The student plus the hint projections: what the optimiser trains. Without a teacher
    config (a bundle teacher: no hidden states) there are no hints."""

    def __init__(self, student: BertPreTrainedModel, teacher: BertConfig | None) -> None:
        super().__init__()
        self.student = student
        s = student.config
        self.mapping = layer_map(s.num_hidden_layers, teacher.num_hidden_layers) if teacher else []
        self.hints = nn.ModuleList(
            nn.Linear(s.hidden_size, teacher.hidden_size) for _ in self.mapping if teacher
        )


class BundleTeacher:
    """A shipped bundle as the teacher: its logits from ONNX Runtime, computed once a training
    row and kept (trimmed to the row's tokens), so later epochs cost no teacher passes."""

    def __init__(self, directory: Path, threads: int) -> None:
        import onnxruntime as ort

        from bertserve.runtime.bundle import BundleError, check_model_file, load_bundle_spec

        self.spec = load_bundle_spec(directory)
        try:
            check_model_file(directory, self.spec)
        except BundleError as exc:
            raise ValueError(str(exc)) from exc
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(directory / self.spec.model_file), options, providers=["CPUExecutionProvider"]
        )
        self.cache: dict[int, list[np.ndarray]] = {}

    def __call__(self, rows: np.ndarray, batch: dict[str, Tensor]) -> Any:
        lengths = batch["attention_mask"].sum(1).tolist()
        todo = [j for j, i in enumerate(rows) if int(i) not in self.cache]
        if todo:
            feeds = {
                name: batch[name][todo].numpy()
                for name in ("input_ids", "attention_mask", "token_type_ids")
            }
            outputs = self.session.run(list(self.spec.outputs), feeds)
            for k, j in enumerate(todo):
                self.cache[int(rows[j])] = [  # copies: a view would keep the whole batch
                    (
                        out[k]
                        if self.spec.output_axes[name] == "sequence"
                        else out[k, : lengths[j]]
                    ).copy()
                    for name, out in zip(self.spec.outputs, outputs, strict=True)
                ]
        width = batch["input_ids"].shape[1]
        result = {}
        for n, name in enumerate(self.spec.outputs):
            values = [self.cache[int(i)][n] for i in rows]
            if self.spec.output_axes[name] != "sequence":  # per token: pad to this batch
                padded = np.zeros((len(values), width, *values[0].shape[1:]), dtype=np.float32)
                for j, v in enumerate(values):
                    padded[j, : len(v)] = v
                values = list(padded)
            result[name] = torch.from_numpy(np.stack(values))
        return SimpleNamespace(**result)


def _gather(x: Tensor, rows: list[np.ndarray], column: int) -> Tensor:
    """x (B, S, ...) at each row's aligned positions -> (sum k, ...)."""
    picks = [x[b, torch.from_numpy(p[:, column])] for b, p in enumerate(rows)]
    return torch.cat(picks)


def batch_loss(
    distiller: Distiller,
    teacher: BertPreTrainedModel | BundleTeacher,
    task: str,
    paired: Paired,
    rows: np.ndarray,
    t: float,
    recipe: DistilRecipe,
    pads: tuple[int, int],
    hooks: tuple[LayerOutputs, LayerOutputs | None],
) -> tuple[Tensor, dict[str, float]]:
    s_batch = batch_tensors(paired.student, rows, pads[0])
    t_batch = batch_tensors(paired.teacher, rows, pads[1])
    with torch.no_grad():
        t_out = teacher(rows, t_batch) if isinstance(teacher, BundleTeacher) else teacher(**t_batch)
    t_layers = hooks[1].take() if hooks[1] else []
    s_out = distiller.student(**s_batch)
    s_layers = hooks[0].take()
    starts = [paired.starts[i] for i in rows]
    if task == "classify":
        soft = soft_loss(s_out.logits, t_out.logits, t)
    elif task == "ner":
        soft = soft_loss(_gather(s_out.logits, starts, 0), _gather(t_out.logits, starts, 1), t)
    else:  # a distribution over the context's words, for starts and for ends
        ends = [paired.ends[i] for i in rows]
        parts = []
        for b in range(len(rows)):
            for pos, s_logits, t_logits in (
                (starts[b][1:], s_out.start_logits[b], t_out.start_logits[b]),
                (ends[b], s_out.end_logits[b], t_out.end_logits[b]),
            ):
                if len(pos):
                    s_pick = s_logits[torch.from_numpy(pos[:, 0])]
                    t_pick = t_logits[torch.from_numpy(pos[:, 1])]
                    parts.append(soft_loss(s_pick[None], t_pick[None], t))
        soft = torch.stack(parts).mean() if parts else s_out.start_logits.sum() * 0
    hint = s_out.loss * 0
    if recipe.hint_weight:
        for j, m in enumerate(distiller.mapping):
            projected = distiller.hints[j](_gather(s_layers[j], starts, 0))
            hint = hint + F.mse_loss(projected, _gather(t_layers[m], starts, 1))
        hint = hint / len(distiller.mapping)
    loss = recipe.hard_weight * s_out.loss + recipe.soft_weight * soft + recipe.hint_weight * hint
    return loss, {"hard": s_out.loss.item(), "soft": soft.item(), "hint": hint.item(), "T": t}


# --- the command --------------------------------------------------------------------------------


def distil(
    task: str,
    teacher_dir: Path,
    student_init: Path,
    data_dir: Path,
    out: Path,
    recipe: DistilRecipe,
) -> dict[str, Any]:
    start_run(task, recipe)
    labels = task_labels(task, data_dir)
    teacher: BertPreTrainedModel | BundleTeacher
    if (teacher_dir / "bundle.json").is_file():
        teacher = BundleTeacher(teacher_dir, recipe.threads or 1)
        if task not in teacher.spec.tasks:
            raise ValueError(f"teacher {teacher_dir} serves {teacher.spec.tasks}, not {task}")
        teacher_labels, teacher_config = teacher.spec.labels, None
        teacher_cased = teacher.spec.tokenizer.case_type_ids
        if recipe.hint_weight:
            log.warning("teacher %s is a bundle: no hidden states, so no hints", teacher_dir)
            recipe = dataclasses.replace(recipe, hint_weight=0.0)
    else:
        teacher = load_model(teacher_dir, HEAD[task]).eval()
        teacher_config = teacher.config
        teacher_cased = teacher.config.case_type_ids
        id2label = teacher.config.id2label or {}
        teacher_labels = [id2label.get(i, "") for i in range(teacher.config.num_labels)]
    if labels and (teacher_labels or [])[: len(labels)] != labels:
        raise ValueError(f"teacher {teacher_dir} labels {teacher_labels} != {labels}")
    overrides: dict[str, Any] = {
        "hidden_dropout_prob": recipe.dropout,
        "attention_probs_dropout_prob": recipe.dropout,
    }
    if labels:
        overrides |= {"id2label": dict(enumerate(labels)), "label2id": None}
    overrides |= case_overrides(task, recipe, student_init)
    student = load_model(student_init, HEAD[task], **overrides)
    student_cased = student.config.case_type_ids
    if recipe.case_dropout and not student_cased:
        raise ValueError("case_dropout needs case_type_ids")
    s_tok, t_tok = BertTokenizer.load(student_init), BertTokenizer.load(teacher_dir)
    paired, counts = paired_features(
        task, s_tok, t_tok, data_dir, recipe, labels or [], teacher_cased, student_cased
    )
    dev, _ = build_features(
        task, s_tok, data_dir, "dev", recipe, labels or [], case_types=student_cased
    )
    if recipe.dev_limit:
        dev = dev.head(recipe.dev_limit)
    distiller = Distiller(student, teacher_config)
    hooks = (
        LayerOutputs(student),
        LayerOutputs(teacher) if isinstance(teacher, BertPreTrainedModel) else None,
    )

    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.json").write_text(
        json.dumps(
            dataclasses.asdict(recipe)
            | {"teacher": str(teacher_dir), "student_init": str(student_init)}
            | counts,
            indent=2,
        )
    )

    provenance = read_provenance(student_init)  # a student narrowed from published weights
    if provenance is not None:
        write_provenance(out, provenance)

    def save() -> None:
        save_model(student, out)
        s_tok.save(out)

    def evaluate() -> dict[str, float]:
        result = dev_metric(task, student, dev, labels, s_tok.pad_id)
        hooks[0].take()  # the evaluation's layer outputs are not hints
        return result

    best, steps, seconds = fit(
        distiller,
        recipe,
        paired.student,
        lambda rows, progress: batch_loss(
            distiller,
            teacher,
            task,
            paired,
            rows,
            temperature(recipe, progress),
            recipe,
            (s_tok.pad_id, t_tok.pad_id),
            hooks,
        ),
        evaluate,
        save,
        out,
        f"distil {task} ({recipe.name})",
    )
    summary = {
        "task": task,
        "best_dev_metric": best,
        "steps": steps,
        "seconds": seconds,
        "train_rows": len(paired.student),
        **counts,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
