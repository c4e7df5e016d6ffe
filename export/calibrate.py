"""`bertserve calibrate`: an embedding bundle's int8 / uint8 ranges (runtime/tasks/quantize.py)
from real text, written beside its graph (bundle.json `quantization`, `embedding_ranges.npy`).

The texts are embedded through the service's own /embed code (prompt, truncation at the
model's length, unit vectors), on the bundle's graph; each width a request may keep gets its
own ranges (the first `w` components normalised again are larger than the full vector's).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bertserve.runtime.bundle import (
    BundleError,
    QuantizationSpec,
    check_model_file,
    load_bundle_spec,
)

RANGES_FILE = "embedding_ranges.npy"
# The widths calibrated besides the model's own: Matryoshka cuts a request may ask for.
WIDTHS = (32, 64, 128, 256, 512, 768, 1024)


def calibration_texts(data: Path, count: int) -> tuple[list[str], str]:
    """`count` texts spread evenly over `data`, and what they are: a SQuAD file (or its
    directory: train-v1.1.json) gives questions and paragraphs, half each (a retrieval model
    embeds both); a .tsv its first column (SST-2's sentences, the header skipped); any other
    file its non-empty lines."""
    if data.is_dir():
        data = data / "train-v1.1.json"
    if data.suffix == ".json":
        articles = json.loads(data.read_text(encoding="utf-8"))["data"]
        paragraphs = [p for a in articles for p in a["paragraphs"]]
        questions = [q["question"] for p in paragraphs for q in p["qas"]]
        contexts = [p["context"] for p in paragraphs]
        half = count // 2
        texts = spread(questions, half) + spread(contexts, count - half)
        return texts, f"{data.name}: {half} questions and {count - half} paragraphs"
    lines = [line for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
    if data.suffix == ".tsv":
        lines = [line.split("\t")[0] for line in lines[1:]]
    return spread(lines, count), f"{data.name}: {min(count, len(lines))} lines"


def spread(items: list[str], count: int) -> list[str]:
    """`count` of `items`, evenly spaced from the first (all of them if there are fewer)."""
    if len(items) <= count:
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def unit_vectors(directory: Path, texts: list[str], batch: int = 64) -> np.ndarray:
    """The texts' /embed vectors (the task's own prepare and finish: prompt, truncation at the
    model's length, unit length) on the bundle's graph, in length-sorted batches."""
    import os

    from tqdm import tqdm

    from bertserve.runtime.batching import RowResult, pad_rows, slice_outputs
    from bertserve.runtime.engine import Engine, EngineOptions
    from bertserve.runtime.tasks import embed
    from bertserve.runtime.tasks.common import TaskContext

    spec = load_bundle_spec(directory)
    engine = Engine(directory, spec, EngineOptions("CPUExecutionProvider", os.cpu_count() or 1))
    ctx = TaskContext.load(directory, spec, max_text_chars=1_000_000)
    request = embed.EmbedRequest(inputs=texts, truncate=True)
    rows, prepared = embed.EMBED.plan(ctx, texts, request)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    results: list[RowResult | None] = [None] * len(rows)
    for start in tqdm(range(0, len(order), batch), desc="calibration texts", leave=False):
        chunk = order[start : start + batch]
        feeds, lengths = pad_rows([rows[i] for i in chunk], spec.tokenizer.pad_id, None)
        outputs = engine.run(feeds)
        for j, i in enumerate(chunk):
            sliced = slice_outputs(outputs, j, lengths[j], rows[i], spec.output_axes)
            results[i] = RowResult(sliced, 0.0, 0.0)
    done = [r for r in results if r is not None]
    return np.asarray(embed.EMBED.finish(ctx, prepared, done, request), dtype=np.float32)


def calibrate_bundle(
    directory: Path,
    data: Path,
    texts: int = 4000,
    command: str | None = None,
    widths: list[int] | None = None,
) -> QuantizationSpec:
    """Embed `texts` calibration texts of `data` with the bundle and write the ranges of each
    width (the model's own and WIDTHS below it, or `widths`) into it, replacing any earlier
    calibration; the graph is untouched."""
    from bertserve.export.bundle import publish
    from bertserve.runtime.tasks.quantize import calibration_ranges

    spec = load_bundle_spec(directory)
    try:
        check_model_file(directory, spec)
    except BundleError as exc:
        raise ValueError(str(exc)) from exc
    if "embed" not in spec.tasks:
        raise ValueError(f"{directory}: serves {', '.join(spec.tasks)}; calibration is for embed")
    corpus, what = calibration_texts(data, texts)
    if len(corpus) < 100:
        raise ValueError(f"{data}: {len(corpus)} texts; calibration needs at least 100")
    vectors = unit_vectors(directory, corpus)
    hidden = spec.architecture.hidden_size
    widths = sorted({hidden, *(w for w in (widths or WIDTHS) if w < hidden)})
    ranges = calibration_ranges(vectors, widths)
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(directory, staging)
    np.save(staging / RANGES_FILE, ranges, allow_pickle=False)
    quantization = QuantizationSpec(
        file=RANGES_FILE,
        sha256=hashlib.sha256((staging / RANGES_FILE).read_bytes()).hexdigest(),
        widths=widths,
        texts=len(corpus),
        data=what + (f" (`{command}`)" if command else ""),
        created_at=datetime.now(UTC).strftime("%Y-%m-%d"),
    )
    publish(staging, spec.model_copy(update={"quantization": quantization}), directory)
    return quantization
