"""What every training run shares: devices and DDP, AdamW with warm-up and linear decay,
checkpoints that resume exactly, a JSONL metrics log and its PNG plot.

Distributed data parallel is switched on by torchrun's environment variables (gloo on CPU, nccl
on CUDA); a plain `bertserve pretrain ...` is a world of one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bertserve.model.checkpoint import load_model, save_model
from bertserve.model.heads import BertPreTrainedModel

log = logging.getLogger(__name__)
STATE_NAME = "trainer_state.pt"


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def setup(cls) -> Dist:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if cuda else "gloo")
        return cls(int(os.environ.get("RANK", "0")), world, local_rank, device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mean(self, values: list[float]) -> list[float]:
        """Average scalars over the processes (for logs: every rank sees the same numbers)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW; biases and LayerNorm parameters are not decayed (as in BERT)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-6)


def warmup_linear_decay(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the peak, then linear decay to zero at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(
    model: nn.Module,
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    clip: float,
) -> None:
    """One update of the fine-tuning-like loops: backward, clip the gradient norm, step the
    optimizer and the schedule, clear the gradients."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def unwrap(model: nn.Module) -> BertPreTrainedModel:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # type: ignore[return-value]


def save_training_state(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Model, optimizer, schedule, RNG and step, written to a temporary directory and renamed,
    so a run killed mid-write leaves the previous checkpoint whole."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(unwrap(model), tmp)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "extra": extra or {},
    }
    torch.save(state, tmp / STATE_NAME)
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def load_training_state(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, dict[str, Any]]:
    """Restore what `save_training_state` wrote; returns (step, extra)."""
    target = unwrap(model)
    loaded = load_model(directory, target.architecture)
    target.load_state_dict(loaded.state_dict())
    target.tie_weights()
    state = torch.load(directory / STATE_NAME, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"]), dict(state["extra"])


class MetricsLog:
    """One JSON object a line: {"step", "kind": "train"|"eval", ...}."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """On resume, forget what was logged after the checkpoint: it will be logged again."""
        kept = [r for r in self.read() if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


def plot_curves(
    records: list[dict[str, Any]],
    path: Path,
    train_keys: list[str],
    eval_keys: list[str],
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    for key in train_keys:
        left.plot([r["step"] for r in train], [r[key] for r in train], label=key)
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_yscale("log")
    left.legend()
    left.set_title(f"{title}: training loss")
    for key in eval_keys:
        right.plot([r["step"] for r in evals], [r[key] for r in evals], marker="o", label=key)
    right.set_xlabel("step")
    right.set_ylabel("held-out")
    right.legend()
    right.set_title(f"{title}: evaluation")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
