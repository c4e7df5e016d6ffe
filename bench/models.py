"""Raw ONNX Runtime throughput of several bundles on the same real inputs, in one process: the
teacher / student / baseline rows of the model card. No HTTP, no queue: the model alone, with
every core, length-sorted batches of the best size (bench.ceiling).

    bertserve bench models --data ../shared/data --bundles runs/bundles/sst2-minilm-int8,...

Inputs by task: SST-2 dev sentences (classify), CoNLL-2003 test sentences (ner), the first 500
SQuAD dev questions with their contexts (qa), each through the task's own `prepare` with the
service's default parameters. Prints a Markdown table with the machine named.
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from bench.ceiling import ceiling, load
from bertserve.model.training.data import tasks as data
from bertserve.runtime.tasks import classify, ner, qa


def rows_for(task: str, ctx, data_dir: Path) -> list:
    if task == "classify":
        texts = [e.text for e in data.read_sst2(data_dir / "sst2", "dev")]
        request = classify.ClassifyRequest(inputs=texts, parameters={"truncation": True})
        return classify.TASK.prepare(ctx, texts, request)[0]
    if task == "ner":
        texts = [" ".join(s.words) for s in data.read_conll(data_dir / "conll2003", "test")]
        return ner.TASK.prepare(ctx, texts, ner.NerRequest(inputs=texts))[0]
    examples = data.read_squad(data_dir / "squad-v1.1", "dev")[:500]
    items = [qa.QaInput(question=e.question, context=e.context) for e in examples]
    return qa.TASK.prepare(ctx, items, qa.QaRequest(inputs=items))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--bundles", required=True, help="comma-separated bundle directories")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or ''}")
    columns = "bundle | task | precision | layers x hidden | MB | sequences/s | best batch | tokens"
    print(f"\n| {columns} |\n" + "|---" * 8 + "|")
    for path in args.bundles.split(","):
        bundle = Path(path)
        engine, ctx = load(bundle)
        spec = ctx.spec
        task = next(t for t in spec.tasks if t in ("classify", "ner", "qa"))
        rows = rows_for(task, ctx, args.data)
        result = ceiling(engine, rows, spec.tokenizer.pad_id, seconds=args.seconds)
        size = (bundle / spec.model_file).stat().st_size / 1e6
        arch = f"{spec.architecture.layers} x {spec.architecture.hidden_size}"
        print(
            f"| {bundle.name} | {task} | {spec.precision} | {arch} | {size:.0f} | "
            f"{result['sequences_per_s']:,.0f} | {result['best_batch']} | "
            f"{result['mean_tokens']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
