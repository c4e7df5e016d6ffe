"""Our export of each encoder family against the tool a user would reach for instead: Optimum's
ONNX export followed by ONNX Runtime's transformer optimiser (model_type "bert", as Optimum's
ORTOptimizer maps every one of these families). Same checkpoint, same inputs, same threads,
in one process, the two graphs timed in alternating rounds: raw ONNX Runtime throughput, no
HTTP.

    make bench-families   # in .venv-bench: optimum-onnx is a bench dependency, never a serving one
    bertserve bench families [--families bert,distilbert,roberta,xlm-roberta,electra]
        [--layers 6] [--hidden 384] [--seq 64] [--rounds 5] [--seconds 1.0] [--out FILE]

Each family's checkpoint is a random-weight sequence classifier of one shape (6 x 384 by
default, the MiniLM shape the project serves; a real vocabulary size per family) built with
transformers, so no hub is needed; the graphs' work does not depend on the weights' values.
Both graphs answer the same padded batch, and their logits must agree to 1e-4 before timing.
Prints a Markdown table: sequences/s of each at batch 1 and batch 32, and the ratio
ours / theirs (median over rounds).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import transformers

VOCAB = {"bert": 30522, "distilbert": 30522, "roberta": 50265, "xlm-roberta": 250002}
VOCAB["electra"] = 30522
VOCAB["modernbert"] = 50368
VOCAB["deberta-v2"] = 128100
CLASSES = {"bert": "Bert", "distilbert": "DistilBert", "roberta": "Roberta"}
CLASSES |= {"xlm-roberta": "XLMRoberta", "electra": "Electra", "modernbert": "ModernBert"}
CLASSES["deberta-v2"] = "DebertaV2"


def checkpoint(root: Path, family: str, layers: int, hidden: int) -> Path:
    """A random-weight sequence classifier (2 labels) of `family`, saved as transformers does."""
    heads = hidden // 64
    shape = {"vocab_size": VOCAB[family], "num_labels": 2}
    config: transformers.PretrainedConfig
    if family == "distilbert":
        config = transformers.DistilBertConfig(
            dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=4 * hidden, **shape
        )
    elif family == "modernbert":  # its own shape: a GeGLU 1.5x wide, every third layer global
        config = transformers.ModernBertConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=3 * hidden // 2,
            vocab_size=VOCAB[family],
            num_labels=2,
        )
    elif family == "deberta-v2":  # v3's layout (deberta-v3-xsmall is 12 x 384)
        config = transformers.DebertaV2Config(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            relative_attention=True,
            position_buckets=256,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            type_vocab_size=0,
            vocab_size=VOCAB[family],
            num_labels=2,
        )
    else:
        body = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads}
        body |= {"intermediate_size": 4 * hidden}
        extra = {"type_vocab_size": 1, "pad_token_id": 1, "max_position_embeddings": 514}
        config_class = getattr(transformers, f"{CLASSES[family]}Config")
        config = config_class(**body, **shape, **(extra if "roberta" in family else {}))
    torch.manual_seed(0)
    model = getattr(transformers, f"{CLASSES[family]}ForSequenceClassification")(config).eval()
    directory = root / family
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def tokenizer_for(directory: Path, family: str) -> None:
    """A WordPiece tokenizer.json beside the checkpoint (our exporter checks the vocabulary
    against the model's; the timed inputs are random ids either way)."""
    from bertserve.model.tokenizer import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(995))]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer.from_vocab(directory / "vocab.txt", lowercase=True).save(directory)


def ours(directory: Path, out: Path) -> Path:
    from bertserve.export.bundle import build_bundle

    build_bundle(directory, ["classify"], out, max_seq_len=128, force=True)
    return out / "model.onnx"


def theirs(directory: Path, out: Path, heads: int, hidden: int) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model
    from optimum.exporters.onnx import main_export

    main_export(
        str(directory), output=out, task="text-classification", opset=17, do_validation=False
    )
    optimised = optimize_model(
        str(out / "model.onnx"), model_type="bert", num_heads=heads, hidden_size=hidden
    )
    optimised.save_model_to_file(str(out / "optimized.onnx"))
    return out / "optimized.onnx"


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds_for(sess: ort.InferenceSession, batch: int, seq: int, vocab: int) -> dict:
    rng = np.random.default_rng(batch * 1000 + seq)
    lengths = [seq, *list(rng.integers(seq // 2, seq + 1, batch - 1))]
    ids = np.full((batch, seq), 1, np.int64)
    mask = np.zeros((batch, seq), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(5, min(vocab, 1000), n)
        mask[i, :n] = 1
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    names = {i.name for i in sess.get_inputs()}
    return {k: v for k, v in feeds.items() if k in names}


def rate(sess: ort.InferenceSession, feeds: dict, seconds: float) -> float:
    """Sequences per second over at least `seconds`, after one warm-up call."""
    sess.run(None, feeds)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
        sess.run(None, feeds)
        calls += 1
    return calls * len(feeds["input_ids"]) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        default="bert,distilbert,roberta,xlm-roberta,electra,modernbert,deberta-v2",
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    batches = [int(b) for b in args.batches.split(",")]
    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"ONNX Runtime {ort.__version__}, {args.threads} intra-op threads; "
        f"{args.layers} x {args.hidden} random-weight classifiers, sequences of {args.seq}. "
        f"Command: `bertserve bench families --layers {args.layers} --hidden {args.hidden} "
        f"--seq {args.seq} --rounds {args.rounds}`.",
        "",
        "| family | batch | ours seq/s | Optimum + ORT optimiser seq/s | ours / theirs | "
        "max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-family-") as tmp:
        root = Path(tmp)
        for family in args.families.split(","):
            directory = checkpoint(root, family, args.layers, args.hidden)
            tokenizer_for(directory, family)
            a = session(ours(directory, root / f"{family}-ours"), args.threads)
            b = session(
                theirs(directory, root / f"{family}-optimum", args.hidden // 64, args.hidden),
                args.threads,
            )
            for batch in batches:
                fa = feeds_for(a, batch, args.seq, VOCAB[family])
                fb = feeds_for(b, batch, args.seq, VOCAB[family])
                diff = float(np.abs(a.run(None, fa)[0] - b.run(None, fb)[0]).max())
                if diff > 1e-4:
                    raise SystemExit(f"{family}: the two graphs differ by {diff:.2e}")
                ra, rb, ratios = [], [], []
                for _ in range(args.rounds):  # alternating: drift hits both alike
                    ra.append(rate(a, fa, args.seconds))
                    rb.append(rate(b, fb, args.seconds))
                    ratios.append(ra[-1] / rb[-1])
                line = (
                    f"| {family} | {batch} | {statistics.median(ra):,.0f} | "
                    f"{statistics.median(rb):,.0f} | {statistics.median(ratios):.2f}x | "
                    f"{diff:.1e} |"
                )
                lines.append(line)
                print(line, flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
