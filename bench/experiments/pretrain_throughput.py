"""Training throughput (tokens/s, forward + backward + AdamW) of pre-training shapes on this
machine, with the MLM head scoring only the selected positions (sparse) or every position (full).

    python bench/pretrain_throughput.py [--shapes 2x128,4x256] [--vocabs 8192,16384] [--steps 8]

Random token ids at sequence 128, batch 32, 20 predictions a sequence (15%); each configuration
is timed in this process after two warm-up steps, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from bertserve.model.config import BertConfig
from bertserve.model.heads import BertForPreTraining


def run(
    layers: int,
    hidden: int,
    vocab: int,
    sparse: bool,
    steps: int,
    batch: int = 32,
    seq: int = 128,
    predictions: int = 20,
) -> float:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        intermediate_size=4 * hidden,
    )
    model = BertForPreTraining(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(5, vocab, (batch, seq))
    positions = torch.stack([torch.randperm(seq - 2)[:predictions] + 1 for _ in range(batch)])
    labels = torch.gather(ids, 1, positions)
    nsp = torch.randint(0, 2, (batch,))
    if not sparse:
        full = torch.full_like(ids, -100)
        full.scatter_(1, positions, labels)

    def step() -> None:
        if sparse:
            out = model(ids, mlm_positions=positions, mlm_labels=labels, next_sentence_label=nsp)
        else:
            out = model(ids, mlm_labels=full, next_sentence_label=nsp)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * seq / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="2x128,4x256")
    parser.add_argument("--vocabs", default="8192,16384,30522")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("| layers x hidden | vocab | sparse MLM tok/s | full MLM tok/s | speed-up |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        layers, hidden = (int(x) for x in shape.split("x"))
        for vocab in (int(v) for v in args.vocabs.split(",")):
            sparse = run(layers, hidden, vocab, True, args.steps)
            full = run(layers, hidden, vocab, False, args.steps)
            print(
                f"| {layers} x {hidden} | {vocab} | {sparse:,.0f} | {full:,.0f} | "
                f"{sparse / full:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
