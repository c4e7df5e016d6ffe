"""Evaluation of an exported bundle through the service's own pre- and post-processing (the code
that serves requests), on ONNX Runtime, without HTTP: what is measured is what is served.

    bertserve evaluate --task classify --bundle bundles/sst2 --data DIR

| task     | data (DIR)                 | metric                                              |
|----------|----------------------------|-----------------------------------------------------|
| classify | sst2/ (dev.tsv) or trec/   | accuracy                                            |
| ner      | conll2003/ (eng.testb)     | entity-level micro F1, exact spans (seqeval) over   |
|          |                            | words; over character spans as /ner answers them    |
|          |                            | (`char_spans`); words again lower-cased             |
|          |                            | (`f1_lowercased`)                                   |
| qa       | squad-v1.1/ (dev)          | EM / F1 with the official normalisation             |
| nsp      | wikipedia text/            | NSP accuracy on pairs from held-out documents       |
| mlm      | wikipedia text/            | top-1 accuracy of /fill-mask on masked whole words  |
| nsp-news | conll2003/ (eng.testb)     | NSP accuracy on pairs of Reuters news sentences     |
| mlm-news | conll2003/ (eng.testb)     | as mlm, on Reuters news sentences                   |
| embed    | sst2/ (dev.tsv sentences)  | cosine with sentence-transformers' encode          |
| rerank   | squad-v1.1/ (dev)          | top-1 and MRR@10 of the gold paragraph among 20 of  |
|          |                            | its article (an embed bundle ranks by cosine)       |
| retrieval| squad-v1.1/ (dev)          | R@1, R@10, MRR@10 over the whole dev corpus: BM25,  |
|          |                            | dense, sparse, their fusion, reranked; through a    |
|          |                            | running service (`--url`: model/training/retrieval) |
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bertserve.model.training.data import tasks as data
from bertserve.model.training.data.wikipedia import is_heldout, read_documents
from bertserve.model.training.metrics import accuracy, entity_f1, span_f1, squad_scores
from bertserve.model.training.retrieval import evaluate_retrieval
from bertserve.runtime.batching import Row, RowResult, pad_rows, slice_outputs
from bertserve.runtime.bundle import load_bundle_spec
from bertserve.runtime.capabilities import evaluations
from bertserve.runtime.engine import Engine, EngineOptions
from bertserve.runtime.errors import RequestError
from bertserve.runtime.tasks import classify, embed, fill_mask, ner, nsp, qa, rerank
from bertserve.runtime.tasks.common import Task, TaskContext


class BundleRunner:
    """A bundle's ONNX Runtime session and task context, fed in length-sorted batches: the
    evaluation's backend in place of the service's batcher."""

    def __init__(self, directory: Path, batch_size: int = 64) -> None:
        self.spec = load_bundle_spec(directory)
        # The service's engine settings, read from the same environment variables, but ONNX
        # Runtime unless BERTSERVE_ENGINE says otherwise: a bundle's `auto` would make which
        # engine a figure (and --record's key) belongs to depend on a timing at load.
        options = EngineOptions(
            "CPUExecutionProvider",
            threads=os.cpu_count() or 1,
            engine=os.environ.get("BERTSERVE_ENGINE", "ort"),
            openvino_precision=os.environ.get("BERTSERVE_OPENVINO_PRECISION", "bundle"),
        )
        self.engine = Engine(directory, self.spec, options)
        self.ctx = TaskContext.load(directory, self.spec, max_text_chars=1_000_000)
        self.batch_size = batch_size

    def run(self, rows: list[Row], desc: str = "") -> list[RowResult]:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        results: list[RowResult | None] = [None] * len(rows)
        # One slot a row at least (the service probes whether a graph takes none; this does not).
        positions = 1 if "mask_positions" in self.spec.inputs else None
        for start in tqdm(range(0, len(order), self.batch_size), desc=desc, leave=False):
            chunk = order[start : start + self.batch_size]
            feeds, lengths = pad_rows(
                [rows[i] for i in chunk], self.spec.tokenizer.pad_id, positions
            )
            outputs = self.engine.run(feeds)
            for j, i in enumerate(chunk):
                results[i] = RowResult(
                    slice_outputs(outputs, j, lengths[j], rows[i], self.spec.output_axes), 0.0, 0.0
                )
        return [r for r in results if r is not None]


def run_task(runner: BundleRunner, task: Task, items: list[Any], request: Any) -> list[Any]:
    """One request's worth of items through the task's own prepare and finish."""
    rows, prepared = task.plan(runner.ctx, items, request)
    return task.finish(runner.ctx, prepared, runner.run(rows, task.capability), request)


def evaluate_classify(runner: BundleRunner, data_dir: Path) -> dict[str, Any]:
    reader = data.read_trec if (data_dir / "train.txt").is_file() else data.read_sst2
    examples = reader(data_dir, "dev")
    texts = [e.text for e in examples]
    request = classify.ClassifyRequest(inputs=texts, parameters={"truncation": True})
    predictions = run_task(runner, classify.TASK, texts, request)
    return {
        "accuracy": accuracy([e.label for e in examples], [p[0]["label"] for p in predictions]),
        "examples": len(examples),
        "data": f"{data_dir.name} dev",
    }


def word_tags(words: list[str], entities: list[dict]) -> list[str]:
    """Word-level BIO tags from character-offset entities over `" ".join(words)`."""
    starts, position = [], 0
    for word in words:
        starts.append(position)
        position += len(word) + 1
    tags = ["O"] * len(words)
    for entity in entities:
        kind = entity["entity_group"]
        inside = [i for i, s in enumerate(starts) if entity["start"] <= s < entity["end"]]
        for k, i in enumerate(inside):
            tags[i] = ("B-" if k == 0 else "I-") + kind
    return tags


def char_spans(words: list[str], tags: list[str]) -> set[tuple[str, int, int]]:
    """Gold entities as (type, start, end) over `" ".join(words)`, from BIO word tags."""
    spans, position, current = set(), 0, None
    for word, tag in zip(words, tags, strict=True):
        if current and not (tag.startswith("I-") and tag[2:] == current[0]):
            spans.add(current)
            current = None
        if tag != "O":  # open an entity, or stretch the open one to this word's end
            start = current[1] if current else position
            current = (tag[2:], start, position + len(word))
        position += len(word) + 1
    if current:
        spans.add(current)
    return spans


def evaluate_ner(runner: BundleRunner, data_dir: Path) -> dict[str, Any]:
    sentences = data.read_conll(data_dir, "test")
    gold = [s.tags for s in sentences]

    def run(words: list[list[str]]) -> list[list[dict]]:
        # The service's default parameters: what is measured is what a plain request gets.
        texts = [" ".join(w) for w in words]
        return run_task(runner, ner.TASK, texts, ner.NerRequest(inputs=texts))

    def by_words(words: list[list[str]], entities: list[list[dict]]) -> dict[str, Any]:
        return entity_f1(gold, [word_tags(w, e) for w, e in zip(words, entities, strict=True)])

    words = [s.words for s in sentences]
    entities = run(words)
    result = by_words(words, entities)
    # Character spans, as /ner answers: an entity the aggregation splits at punctuation inside a
    # CoNLL word ("AL-AIN") is wrong here even where the word-level count forgives it.
    result["char_spans"] = span_f1(
        [char_spans(s.words, s.tags) for s in sentences],
        [{(e["entity_group"], e["start"], e["end"]) for e in found} for found in entities],
    )
    # The same sentences written in lower case (a transcript, a chat message): what a model that
    # reads capitals (case_type_ids) keeps without them. An uncased model scores the same.
    lowered = [[w.lower() for w in s.words] for s in sentences]
    result["f1_lowercased"] = by_words(lowered, run(lowered))["f1"]
    return result | {"data": "CoNLL-2003 eng.testb"}


def evaluate_qa(runner: BundleRunner, data_dir: Path) -> dict[str, Any]:
    examples = data.read_squad(data_dir, "dev")
    # The service's defaults (max_answer_len 15, doc_stride 128, ...), one request a question
    # so that a refused one (a question over 64 tokens) is scored as an empty answer.
    request = qa.QaRequest(inputs=[{"question": "?", "context": "?"}])
    inputs: list[qa.QaWindows] = []
    rows: list[Row] = []
    kept: list[int | None] = []  # each example's input, or None where it was refused
    for example in examples:
        item = qa.QaInput(question=example.question, context=example.context)
        try:
            item_rows, prepared = qa.TASK.plan(runner.ctx, [item], request)
        except RequestError:
            kept.append(None)
            continue
        kept.append(len(inputs))
        inputs.extend(prepared)
        rows.extend(item_rows)
    answers = qa.TASK.finish(runner.ctx, inputs, runner.run(rows, "qa"), request)
    predictions = [answers[k]["answer"] if k is not None else "" for k in kept]
    return squad_scores(predictions, [e.answers for e in examples]) | {
        "data": "SQuAD v1.1 dev",
        "parameters": request.parameters.model_dump(),
        "refused": kept.count(None),
    }


def heldout_documents(data_dir: Path, fraction: float, limit: int) -> list[list[str]]:
    docs = [d.sentences for d in read_documents(data_dir) if is_heldout(d.id, fraction)]
    return [d for d in docs if len(d) >= 4][:limit]


WIKIPEDIA = "held-out Wikipedia documents (hash fraction {fraction})"
NEWS = "CoNLL-2003 test: Reuters news stories, 1996-97 (sentences as its words, space-joined)"


def news_documents(data_dir: Path) -> list[list[str]]:
    return [d for d in data.read_conll_documents(data_dir, "test") if len(d) >= 4]


def evaluate_nsp(
    runner: BundleRunner, data_dir: Path, fraction: float = 0.02, pairs: int = 2000, seed: int = 0
) -> dict[str, Any]:
    return nsp_accuracy(runner, heldout_documents(data_dir, fraction, 10_000), pairs, seed) | {
        "data": WIKIPEDIA.format(fraction=fraction)
    }


def evaluate_nsp_news(runner: BundleRunner, data_dir: Path) -> dict[str, Any]:
    return nsp_accuracy(runner, news_documents(data_dir), 2000, 0) | {"data": NEWS}


def nsp_accuracy(
    runner: BundleRunner, docs: list[list[str]], pairs: int, seed: int
) -> dict[str, Any]:
    """Half true continuations (sentence i+1 after i), half a sentence of another document."""
    rng = random.Random(seed)
    texts, gold = [], []
    for k in range(pairs):
        doc = rng.randrange(len(docs))
        i = rng.randrange(len(docs[doc]) - 1)
        if k % 2 == 0:
            texts.append((docs[doc][i], docs[doc][i + 1]))
            gold.append(True)
        else:
            other = rng.choice([d for d in range(len(docs)) if d != doc])
            texts.append((docs[doc][i], rng.choice(docs[other])))
            gold.append(False)
    inputs = [nsp.NspInput(text=a, text_pair=b) for a, b in texts]
    request = nsp.NspRequest(inputs=inputs, parameters={"truncation": True})
    predicted = [r["is_next"] for r in run_task(runner, nsp.TASK, inputs, request)]
    return {"nsp_accuracy": accuracy(gold, predicted), "pairs": len(inputs)}


def evaluate_mlm(
    runner: BundleRunner,
    data_dir: Path,
    fraction: float = 0.02,
    sentences: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    return mlm_accuracy(runner, heldout_documents(data_dir, fraction, 10_000), sentences, seed) | {
        "data": WIKIPEDIA.format(fraction=fraction)
    }


def evaluate_mlm_news(runner: BundleRunner, data_dir: Path) -> dict[str, Any]:
    return mlm_accuracy(runner, news_documents(data_dir), 2000, 0) | {"data": NEWS}


def mlm_accuracy(
    runner: BundleRunner, docs: list[list[str]], sentences: int, seed: int
) -> dict[str, Any]:
    """One whole word (a single word piece of 3+ letters) a sentence replaced by [MASK]; hit if
    /fill-mask's top prediction is that word."""
    rng = random.Random(seed)
    tok = runner.ctx.tokenizer
    # An uncased model predicts "paris" for "Paris": compare in the model's own case, so that
    # capitalised words are in its test set too.
    fold = str.lower if runner.spec.tokenizer.lowercase else str
    texts, gold = [], []
    for doc in docs:
        for sentence in doc:
            words = sentence.split()
            candidates = [
                i
                for i, w in enumerate(words)
                if w.isalpha() and len(w) >= 3 and tok.token_to_id(fold(w)) is not None
            ]
            if not 6 <= len(words) <= 60 or not candidates:  # short enough that nothing is cut
                continue
            i = rng.choice(candidates)
            gold.append(fold(words[i]))
            texts.append(" ".join([*words[:i], "[MASK]", *words[i + 1 :]]))
        if len(texts) >= sentences:
            break
    texts, gold = texts[:sentences], gold[:sentences]
    if not texts:
        raise ValueError("no sentence of 6-60 words with a whole word in the vocabulary")
    request = fill_mask.FillMaskRequest(inputs=texts, parameters={"top_k": 1, "truncation": True})
    outputs = run_task(runner, fill_mask.TASK, texts, request)
    predicted = [o[0]["token_str"] for o in outputs]
    return {"mlm_word_accuracy": accuracy(gold, predicted), "sentences": len(texts)}


def evaluate_embed(runner: BundleRunner, data_dir: Path) -> dict[str, Any]:
    """Agreement with sentence-transformers' own `encode` of the source checkpoint, on real
    sentences (SST-2 dev), through the service's /embed code: the bundle is the published model."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from bertserve.model.sources import resolve_init

    texts = [e.text for e in data.read_sst2(data_dir, "dev")]
    request = embed.EmbedRequest(inputs=texts, truncate=True)
    ours = np.asarray(run_task(runner, embed.EMBED, texts, request), dtype=np.float64)
    source, _ = resolve_init(runner.spec.source.checkpoint)
    reference = SentenceTransformer(str(source), device="cpu").encode(
        texts, normalize_embeddings=True, batch_size=64
    )
    cosine = (ours * reference).sum(-1) / np.linalg.norm(ours, axis=-1)
    cosine /= np.linalg.norm(reference, axis=-1)
    return {
        "min_cosine_vs_sentence_transformers": float(cosine.min()),
        "mean_cosine_vs_sentence_transformers": float(cosine.mean()),
        "texts": len(texts),
        "data": f"{data_dir.name} dev sentences",
    }


def evaluate_rerank(
    runner: BundleRunner, data_dir: Path, questions: int = 300, count: int = 20
) -> dict[str, Any]:
    """Held-out SQuAD v1.1 dev questions (never trained on), drawn with a fixed seed: the gold
    paragraph among up to `count` paragraphs of its article, ranked through the service's
    /rerank code; an embedding bundle ranks them by the cosine of their /embed vectors (the
    retrieval baseline a reranker should beat). SQuAD marks one paragraph a question's own, but
    another of its article may hold the answer too: `top1_holds_answer` also counts a first
    paragraph that holds one of the question's answers (as whole words, normalised as SQuAD
    scores answers): an upper bound on the errors that may be the mark's, not the model's."""
    import numpy as np

    from bertserve.model.training.rerank import candidates, holds_answer, read_articles

    articles, pool = read_articles(data_dir / "dev-v1.1.json")
    rng = np.random.default_rng(0)
    picked = [pool[i] for i in rng.permutation(len(pool))[:questions]]
    by_reranker = "rerank" in runner.spec.tasks
    top1, reciprocal, answered = 0, 0.0, 0
    for q in tqdm(picked, desc="rerank", leave=False):
        docs = [articles[q.article][i] for i in candidates(q, articles, count, rng)]
        if by_reranker:
            request = rerank.RerankRequest(query=q.text, texts=docs, truncate=True)
            ranked = run_task(runner, rerank.RERANK, docs, request)
            order = [r["index"] for r in ranked]
        else:
            texts = [q.text, *docs]
            vectors = np.asarray(
                run_task(
                    runner, embed.EMBED, texts, embed.EmbedRequest(inputs=texts, truncate=True)
                )
            )
            order = np.argsort(-(vectors[1:] @ vectors[0]), kind="stable").tolist()
        rank = order.index(0) + 1  # the gold paragraph is candidate 0
        top1 += rank == 1
        reciprocal += 1.0 / rank if rank <= 10 else 0.0
        answered += rank == 1 or holds_answer(docs[order[0]], q.answers)
    return {
        "top1": round(100.0 * top1 / len(picked), 2),
        "mrr10": round(reciprocal / len(picked), 4),
        "top1_holds_answer": round(100.0 * answered / len(picked), 2),
        "questions": len(picked),
        "candidates": count,
        "ranked_by": "cross-encoder (/rerank)" if by_reranker else "embedding cosine (/embed)",
        "data": "SQuAD v1.1 dev: the gold paragraph among up to 20 of its article",
    }


EVALUATORS = {
    "classify": evaluate_classify,
    "ner": evaluate_ner,
    "qa": evaluate_qa,
    "nsp": evaluate_nsp,
    "mlm": evaluate_mlm,
    "nsp-news": evaluate_nsp_news,
    "mlm-news": evaluate_mlm_news,
    "embed": evaluate_embed,
    "rerank": evaluate_rerank,
    # over HTTP, of a running service's models (`evaluate(..., url=...)`), not of one bundle
    "retrieval": evaluate_retrieval,
}


def evaluate(
    task: str, bundle: Path | None, data_dir: Path, url: str | None = None, **options: Any
) -> dict[str, Any]:
    """`task`'s evaluation of `bundle`; retrieval's, of the service at `url` (`options`: its
    model names and question counts)."""
    if task not in EVALUATORS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(EVALUATORS)}")
    if task == "retrieval":
        if url is None:
            raise ValueError("--task retrieval measures a running service: give its --url")
        return evaluate_retrieval(url, data_dir, **options)
    if bundle is None:
        raise ValueError(f"--task {task} evaluates a bundle: give --bundle")
    runner = BundleRunner(bundle)
    # The capability it measures (runtime/capabilities.py); a rerank evaluation also
    # measures a bi-encoder (embed), the baseline a cross-encoder must beat.
    needed = [evaluations()[task], *(["embed"] if task == "rerank" else [])]
    if not set(needed) & set(runner.spec.tasks):
        raise ValueError(f"bundle {bundle} serves {runner.spec.tasks}, not {needed}")
    evaluator: Any = EVALUATORS[task]
    result: dict[str, Any] = evaluator(runner, data_dir)
    if runner.engine.engine_name != "onnxruntime":  # BERTSERVE_ENGINE, or the bundle's field
        choice = runner.engine.engine_choice or {}
        result["engine"] = {
            "name": runner.engine.engine_name,
            "precision": choice.get("precision_in_use"),
        }
    return result


# The instruction sets that choose ONNX Runtime's int8 and float kernels on x86-64: an int8
# model's answers differ with them in the third decimal (docs/model-card.md#across-cpus).
KERNEL_FEATURES = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_int8",
)


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU and ONNX Runtime a figure was measured on: its model name and the instruction
    sets among KERNEL_FEATURES it has (none where `cpuinfo` is missing: off Linux)."""
    import platform

    import onnxruntime

    name, flags = platform.processor(), set[str]()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {
        "cpu": name,
        "isa": [f for f in KERNEL_FEATURES if f in flags],
        "onnxruntime": onnxruntime.__version__,
    }


def metrics_key(task: str, result: dict[str, Any]) -> str:
    """Where `result` goes in a bundle's metrics: `task` on ONNX Runtime, else beside it with
    the engine and precision it ran on ("qa openvino-bf16")."""
    engine = result.get("engine")
    return f"{task} {engine['name']}-{engine['precision']}" if engine else task


def record(bundle: Path, task: str, result: dict[str, Any]) -> None:
    """Write `result` into the bundle's bundle.json as metrics[task] (metrics_key: with the
    engine's name where it is not ONNX Runtime), with the machine it was measured on, validated
    as the service will read it."""
    result = {**result, "machine": machine()}
    if "engine" in result:
        import openvino

        result["machine"]["openvino"] = openvino.__version__
    task = metrics_key(task, result)
    path = bundle / "bundle.json"
    spec = load_bundle_spec(bundle)
    updated = spec.model_copy(update={"metrics": {**spec.metrics, task: result}})
    path.write_text(updated.model_dump_json(indent=2) + "\n", encoding="utf-8")
    load_bundle_spec(bundle)
