"""Build and verify bundles: checkpoint -> ONNX -> optimised -> chosen precision -> directory.

A bundle is written to a temporary directory and renamed into place, so a failed export never
leaves a half bundle where the service would find it.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import logging
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bertserve.export.colbert import read_colbert
from bertserve.export.graph import (
    OPSET,
    TaskGraph,
    export_onnx,
    graph_io,
    head_file,
    optimise,
    output_axes,
    own_tasks,
    read_model_max_length,
    read_pooling,
    read_prompts,
    read_sentence_settings,
    resolve_tasks,
    task_architecture,
)
from bertserve.export.parity import (
    MIN_AGREEMENT,
    TOLERANCE,
    VERIFY_ALPHA,
    agreement_p_value,
    compare,
    onnx_outputs,
    sample_feeds,
    torch_outputs,
)
from bertserve.export.sparse import read_sparse_encoder
from bertserve.export.variants import CONVERT, HEAD_CONVERT, RECONVERT
from bertserve.model.checkpoint import (
    load_model,
    read_config,
    read_state_dict,
    sha256,
    weights_path,
)
from bertserve.model.families import OWN_MODEL_TYPES
from bertserve.model.heads import BertPreTrainedModel
from bertserve.model.sources import read_provenance, read_soup, resolve_init
from bertserve.model.tokenizer import BertTokenizer
from bertserve.runtime.bundle import (
    FORMAT_VERSION,
    BundleError,
    BundleSpec,
    check_model_file,
    load_bundle_spec,
)
from bertserve.runtime.capabilities import CAPABILITIES, HEAD_GRAPHS, head_outputs

log = logging.getLogger(__name__)

# An inference-free sparse bundle's static side: a float32 weight a vocabulary id.
STATIC_FILE = "sparse_static.npy"
# A head graph's task by its output (runtime.capabilities.HEAD_GRAPHS, turned round).
HEAD_TASK = {output: task for task, output in HEAD_GRAPHS.items()}
# A variant may lose at most this much task accuracy (points) against fp32 on the eval data.
MAX_ACCURACY_DROP = 1.0
SAMPLE_TEXTS = [
    "The film is a charming and often affecting journey.",
    "Aristotle was born in Stagira in 384 BC and studied at Plato's Academy in Athens.",
    "Who was the first president of the United States?",
    "EU rejects German call to boycott British lamb.",
    "Short.",
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France.",
]


def read_eval_data(path: Path, limit: int = 1000) -> tuple[list[str], list[int] | None]:
    """Texts (and integer labels, if there is a `label` column) from a TSV with a header, as
    GLUE's SST-2 `dev.tsv`; the text is the `sentence` column, else the first one."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:limit]
    if not rows:
        raise ValueError(f"--eval-data {path} has no rows")
    text_key = "sentence" if "sentence" in rows[0] else next(iter(rows[0]))
    texts = [r[text_key] for r in rows]
    labels = [int(r["label"]) for r in rows] if "label" in rows[0] else None
    return texts, labels


def variant_accuracy(
    fp32: Path,
    variant: Path,
    precision: str,
    tokenizer: BertTokenizer,
    inputs: list[str],
    texts: list[str],
    labels: list[int] | None,
    max_len: int,
    source: str,
    reference: str = "fp32",
    case_types: int = 0,
    heads: tuple[dict[str, Path], dict[str, Path]] = ({}, {}),
) -> dict[str, Any]:
    """The variant against its reference graph on real texts: largest logit difference, top-1
    agreement and, with labels, the accuracy of each. `heads`: the reference's and the
    variant's head graphs (bundle.json "heads"), run after each."""
    ref_out: dict[str, list] = {}
    var_out: dict[str, list] = {}
    per_batch = []
    for start in range(0, len(texts), 64):
        feeds = sample_feeds(tokenizer, texts[start : start + 64], inputs, max_len, case_types)
        a, b = onnx_outputs(fp32, feeds, heads[0]), onnx_outputs(variant, feeds, heads[1])
        per_batch.append(compare(a, b, feeds))
        for name in a:
            ref_out.setdefault(name, []).append(a[name])
            var_out.setdefault(name, []).append(b[name])
    compared = sum(r["compared"] for r in per_batch)
    result: dict[str, Any] = {
        "reference": reference,
        "data": source,
        "texts": len(texts),
        "max_abs_diff": max(r["max_abs_diff"] for r in per_batch),
        "top1_agreement": sum(r["top1_agreement"] * r["compared"] for r in per_batch) / compared,
        "min_agreement": MIN_AGREEMENT[precision],
    }
    # A one-output head (a reranker's relevance logit) has no label to be right about: its
    # variant is measured by ranking (`evaluate --task rerank`), beside max_abs_diff here.
    logits = ref_out.get("logits")
    if labels is not None and logits is not None and logits[0].ndim == 2 and logits[0].shape[1] > 1:
        import numpy as np

        gold = np.asarray(labels)
        acc = {
            name: float((np.concatenate(out["logits"]).argmax(-1) == gold).mean() * 100)
            for name, out in ((reference, ref_out), (precision, var_out))
        }
        result |= {
            f"accuracy_{reference}": acc[reference],
            f"accuracy_{precision}": acc[precision],
            "accuracy_drop": acc[reference] - acc[precision],
            "max_accuracy_drop": MAX_ACCURACY_DROP,
        }
    return result


def torch_parity(
    model: BertPreTrainedModel,
    tasks: list[str],
    tokenizer: BertTokenizer,
    onnx_path: Path,
    inputs: list[str],
    outputs: list[str],
    max_len: int,
    pooling: dict[str, Any] | None = None,
    sparse: dict[str, Any] | None = None,
    projection: Any = None,
    heads: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """The torch model and an exported graph (and its `heads`' graphs) on the same sample
    sentences, compared."""
    feeds = sample_feeds(tokenizer, SAMPLE_TEXTS, inputs, max_len, model.config.case_type_ids)
    graph = TaskGraph(model, tasks, str((pooling or {}).get("mode", "mean")), sparse, projection)
    return compare(
        torch_outputs(graph, feeds, inputs, outputs),
        onnx_outputs(onnx_path, feeds, heads),
        feeds,
    )


def head_graphs(work: Path, stem: str, tasks: list[str]) -> dict[str, Path]:
    """A bundle of several heads' head graphs beside its model graph `work/stem.onnx`: output
    name -> file (export.graph.head_file); none for a bundle of one head."""
    by_output = {HEAD_GRAPHS[t]: t for t in HEAD_GRAPHS if t in tasks}
    return {
        output: head_file(work / f"{stem}.onnx", by_output[output])
        for output in head_outputs(tasks)
    }


def head_labels(config: Any, tasks: list[str]) -> list[str] | None:
    """The labels of a classifying or tagging head, in id order (None for other tasks)."""
    if not any(CAPABILITIES[t].labelled for t in tasks):
        return None
    if config.id2label is None:
        raise ValueError(f"a {'/'.join(tasks)} head needs id2label in the checkpoint's config")
    return [config.id2label[i] for i in range(config.num_labels)]


def variant_problem(result: dict[str, Any]) -> str | None:
    if result["top1_agreement"] < result["min_agreement"]:
        return (
            f"top-1 agreement with {result['reference']} is {result['top1_agreement']:.4f}, "
            f"below {result['min_agreement']}"
        )
    if result.get("accuracy_drop", 0.0) > MAX_ACCURACY_DROP:
        return f"accuracy drops {result['accuracy_drop']:.2f} points (> {MAX_ACCURACY_DROP})"
    return None


def build_bundle(
    checkpoint: Path,
    tasks: list[str],
    out: Path,
    precision: str = "fp32",
    max_seq_len: int | None = None,
    eval_data: Path | None = None,
    metrics: dict[str, Any] | None = None,
    force: bool = False,
    command: str | None = None,
    default: bool = False,
    *,
    pooling_mode: str | None = None,
    normalize: bool | None = None,
    lower_case: bool | None = None,
    source_label: str | None = None,
) -> BundleSpec:
    """Export `checkpoint` for `tasks` into the bundle `out`. A sentence-transformers
    directory's settings (sequence length, lower-casing, pooling, normalisation, prompts) are
    taken from it; `max_seq_len`, `pooling_mode`, `normalize` and `lower_case` override them.
    `source_label` is what bundle.json names as the checkpoint (an ONNX source imported into a
    temporary one)."""
    given = source_label or str(checkpoint)
    provenance = read_provenance(checkpoint) if checkpoint.is_dir() else None
    if not checkpoint.is_dir():  # an installed package that ships a checkpoint
        checkpoint, provenance = resolve_init(given)
    root = checkpoint  # a SparseEncoder's encoder may sit in a folder of its (Router's)
    sparse_source = read_sparse_encoder(root) if "sparse" in tasks else None
    if sparse_source is not None:
        checkpoint = sparse_source.encoder
    config = read_config(checkpoint)
    tokenizer = BertTokenizer.load(checkpoint)
    colbert = read_colbert(root, tokenizer.tokenizer) if "multivector" in tasks else None
    sentence = read_sentence_settings(checkpoint)
    if lower_case is None:
        lower_case = sentence.get("do_lower_case", False)
    if lower_case:
        tokenizer = tokenizer.lower_casing()
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"model's {config.vocab_size} embeddings"
        )
    arch = config.architectures[0] if config.architectures else None
    if config.model_type in OWN_MODEL_TYPES:
        tasks = own_tasks(tasks, arch)
    else:
        keys = set(read_state_dict(checkpoint, config, arch or "BertModel"))
        tasks = resolve_tasks(tasks, keys, arch)
    if "rerank" in tasks and "multivector" not in tasks and config.num_labels != 1:
        raise ValueError(
            f"a rerank bundle needs a cross-encoder (a classifier with one output); "
            f"{checkpoint} has {config.num_labels} labels"
        )
    # As sentence-transformers reads it: sentence_bert_config.json's max_seq_length, else the
    # tokenizer's model_max_length; capped at the model's positions, and by default at 512.
    limit = sentence.get("max_seq_length") or min(512, read_model_max_length(checkpoint) or 512)
    if colbert is not None:  # PyLate's tokenizer cuts at the sides' lengths, not at this
        sides = colbert.settings
        limit = max(sides["query_length"], sides["document_length"])
    max_len = max_seq_len or min(limit, config.max_sequence)
    if not 8 <= max_len <= config.max_sequence:
        named = (
            "--max-seq-len" if max_seq_len else "the length its files give (--max-seq-len sets it)"
        )
        raise ValueError(f"{named} {max_len} must be in 8..{config.max_sequence}")
    if precision not in TOLERANCE:
        raise ValueError(f"--precision {precision!r} is not one of {sorted(TOLERANCE)}")
    model = load_model(checkpoint, task_architecture(tasks)).eval()
    inputs, outputs = graph_io(tasks, config.family.segments)
    pooling = read_pooling(checkpoint) if "embed" in tasks else None
    if pooling is not None:
        pooling["mode"] = pooling_mode or pooling["mode"]
        if normalize is not None:
            pooling["normalize"] = normalize
    elif pooling_mode is not None or normalize is not None:
        raise ValueError("--pooling and --normalize apply to an embed bundle only")
    prompts = read_prompts(root) if {"embed", "sparse", "multivector"} & set(tasks) else {}
    sparse = dict(sparse_source.settings) if sparse_source is not None else None
    projection = colbert.projection if colbert is not None else None
    multivector = dict(colbert.settings) if colbert is not None else None
    if multivector is not None:  # a side longer than the model's positions cannot run anyway
        for side in ("query_length", "document_length"):
            multivector[side] = min(multivector[side], max_len)
    if pooling is not None and pooling["mode"] == "mean" and prompts["prompts"]:
        pooling_config = checkpoint / "1_Pooling" / "config.json"
        if (
            pooling_config.is_file()
            and json.loads(pooling_config.read_text()).get("include_prompt", True) is False
        ):
            raise ValueError(
                f"{pooling_config}: include_prompt false (the prompt's tokens left out of the "
                "mean) is not supported; the bundle would pool them in"
            )

    with tempfile.TemporaryDirectory(prefix="bertserve-export-") as tmp:
        work = Path(tmp)
        export_onnx(
            model,
            tasks,
            work / "raw.onnx",
            str((pooling or {}).get("mode", "mean")),
            sparse,
            projection,
        )
        fused = optimise(
            work / "raw.onnx", work / "fp32.onnx", config.num_attention_heads, config.hidden_size
        )
        heads = head_graphs(work, "fp32", tasks)
        for output, path in heads.items():  # a head's graph: no transformer fusions to make
            shutil.move(head_graphs(work, "raw", tasks)[output], path)
        check = torch_parity(
            model,
            tasks,
            tokenizer,
            work / "fp32.onnx",
            inputs,
            outputs,
            max_len,
            pooling,
            sparse,
            projection,
            heads,
        )
        if check["max_abs_diff"] > TOLERANCE["fp32"]:
            raise ValueError(f"ONNX Runtime differs from torch by {check['max_abs_diff']:.2e}")
        accuracy = None
        final = work / "fp32.onnx"
        final_heads = heads
        if precision != "fp32":
            final = work / f"{precision}.onnx"
            CONVERT[precision](work / "fp32.onnx", final)
            final_heads = head_graphs(work, precision, tasks)
            for output, path in final_heads.items():
                HEAD_CONVERT[precision](heads[output], path)
            problem: str | None
            if eval_data is None:
                problem = "not measured: give --eval-data (a TSV of real text)"
            else:
                texts, labels = read_eval_data(eval_data)
                accuracy = variant_accuracy(
                    work / "fp32.onnx",
                    final,
                    precision,
                    tokenizer,
                    inputs,
                    texts,
                    labels,
                    max_len,
                    str(eval_data),
                    case_types=config.case_type_ids,
                    heads=(heads, final_heads),
                )
                problem = variant_problem(accuracy)
            if problem and not force:
                raise ValueError(f"{precision} variant refused: {problem} (--force to keep it)")
            if problem:
                accuracy = (accuracy or {}) | {"forced": problem}

        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copyfile(final, staging / "model.onnx")
        head_specs = {}
        for output, path in final_heads.items():
            name = head_file(Path("model.onnx"), HEAD_TASK[output]).name
            shutil.copyfile(path, staging / name)
            head_specs[output] = {"file": name, "sha256": sha256(staging / name)}
        if final != work / "fp32.onnx":  # the variant's own parity with torch, recorded
            check = torch_parity(
                model,
                tasks,
                tokenizer,
                final,
                inputs,
                outputs,
                max_len,
                pooling,
                sparse,
                projection,
                final_heads,
            )
        tokenizer.tokenizer.save(str(staging / "tokenizer.json"))
        if sparse_source is not None and sparse_source.static_weights is not None:
            assert sparse is not None
            np.save(staging / STATIC_FILE, sparse_source.static_weights, allow_pickle=False)
            sparse |= {"static_file": STATIC_FILE, "static_sha256": sha256(staging / STATIC_FILE)}
        spec = BundleSpec(
            format_version=FORMAT_VERSION,
            name=out.name,
            tasks=tasks,
            labels=head_labels(model.config, tasks),
            max_seq_len=max_len,
            tokenizer={
                "lowercase": tokenizer.lowercase,
                "vocab_size": tokenizer.vocab_size,
                "pad_id": tokenizer.pad_id,
                "unk_id": tokenizer.unk_id,
                "cls_id": tokenizer.cls_id,
                "sep_id": tokenizer.sep_id,
                "mask_id": tokenizer.mask_id,
                "mask_token": tokenizer.mask_token,
                "case_type_ids": config.case_type_ids,
            },
            inputs=inputs,
            outputs=outputs,
            output_axes=output_axes(tasks),
            pooling=pooling,
            sparse=sparse,
            multivector=multivector,
            heads=head_specs,
            **prompts,
            precision=precision,
            model_sha256=sha256(staging / "model.onnx"),
            export_parity=check | {"tolerance": TOLERANCE[precision]},
            opset=OPSET,
            architecture={
                "model_type": config.model_type,
                "layers": config.num_hidden_layers,
                "hidden_size": config.hidden_size,
                "heads": config.num_attention_heads,
                "vocab_size": config.vocab_size,
                # the positions an input may use (RoBERTa's family spends two on padding_idx)
                "max_position_embeddings": config.max_sequence,
            },
            fused_nodes=fused,
            source={
                "checkpoint": given,
                "sha256": sha256(weights_path(checkpoint)),
                "architecture": model.architecture,
                "init": provenance.to_dict() if provenance else None,
                "soup": read_soup(checkpoint),
            },
            variant_accuracy=accuracy,
            metrics=metrics or {},
            created_by=command or "bertserve export " + shlex.join(sys.argv[1:]),
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            default=default,
        )
        publish(staging, spec, out)
    return spec


def bundle_tokenizer(directory: Path, spec: BundleSpec) -> BertTokenizer:
    """A bundle's tokenizer with the special tokens its bundle.json names."""
    from tokenizers import Tokenizer

    ids = spec.tokenizer
    raw = Tokenizer.from_file(str(directory / ids.file))
    specials = {
        role: raw.id_to_token(getattr(ids, f"{role}_id")) or f"<no id {getattr(ids, f'{role}_id')}>"
        for role in ("pad", "unk", "cls", "sep")
    }
    return BertTokenizer.from_file(directory / ids.file, specials | {"mask": ids.mask_token})


def publish(staging: Path, spec: BundleSpec, out: Path) -> None:
    """Write `spec` into the staged bundle, check it loads, and only then replace `out`."""
    (staging / "bundle.json").write_text(spec.model_dump_json(indent=2) + "\n", "utf-8")
    load_bundle_spec(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def convert_bundle(
    directory: Path,
    precision: str,
    eval_data: Path,
    force: bool = False,
    command: str | None = None,
) -> BundleSpec:
    """Rewrite a bundle's graph at another precision without its checkpoint: from fp32 to any,
    or along `RECONVERT` (int8 -> int8-nf4-embeddings and the like). The new graph is
    measured against the old one on `eval_data` and refused, as at export, when it disagrees;
    the bundle's task metrics and int8 calibration are dropped (they were of the old graph:
    evaluate and calibrate it again)."""
    spec = load_bundle_spec(directory)
    try:
        check_model_file(directory, spec)
    except BundleError as exc:
        raise ValueError(str(exc)) from exc
    if precision == spec.precision:
        raise ValueError(f"{directory} is already {precision}")
    if spec.heads:
        raise ValueError(
            f"{directory} has head graphs of its own ({', '.join(spec.heads)}): export "
            f"{precision} from the checkpoint instead"
        )
    convert = CONVERT.get(precision) if spec.precision == "fp32" else None
    convert = convert or RECONVERT.get((spec.precision, precision))
    if convert is None:
        raise ValueError(
            f"{directory} is {spec.precision}: it converts only from fp32, or along "
            f"{sorted(RECONVERT)}; export {precision} from the checkpoint instead"
        )
    tokenizer = bundle_tokenizer(directory, spec)
    old = directory / spec.model_file
    with tempfile.TemporaryDirectory(prefix="bertserve-convert-") as tmp:
        new = Path(tmp) / "model.onnx"
        convert(old, new)
        texts, labels = read_eval_data(eval_data)
        accuracy = variant_accuracy(
            old,
            new,
            precision,
            tokenizer,
            spec.inputs,
            texts,
            labels,
            spec.max_seq_len,
            str(eval_data),
            reference=spec.precision,
            case_types=spec.tokenizer.case_type_ids,
        )
        problem = variant_problem(accuracy)
        if problem and not force:
            raise ValueError(f"{precision} variant refused: {problem} (--force to keep it)")
        converted = spec.model_copy(
            update={
                "precision": precision,
                "model_sha256": sha256(new),
                "variant_accuracy": accuracy
                | {"converted_from": {"precision": spec.precision, "sha256": spec.model_sha256}}
                | ({"forced": problem} if problem else {}),
                "export_parity": (spec.export_parity or {})
                | {"graph": f"the {spec.precision} graph this one was converted from"},
                "metrics": {},
                "quantization": None,  # int8 ranges of the old graph: calibrate it again
                "created_by": f"{spec.created_by}; then "
                + (command or f"bertserve convert {directory} --precision {precision}"),
                "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
        )
        staging = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(directory, staging)
        shutil.copyfile(new, staging / spec.model_file)
        if spec.quantization is not None:
            (staging / spec.quantization.file).unlink(missing_ok=True)
        publish(staging, converted, directory)
    return converted


def verify(directory: Path) -> dict[str, Any]:
    """Check a bundle as the service will load it; raises ValueError naming the first problem.
    Parity with the source checkpoint is checked when that checkpoint is at hand unchanged."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    spec = load_bundle_spec(directory)
    try:
        check_model_file(directory, spec)
    except BundleError as exc:
        raise ValueError(str(exc)) from exc
    try:
        session = ort.InferenceSession(
            str(directory / spec.model_file), providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # ORT raises its own exception types
        raise ValueError(
            f"{directory / spec.model_file}: ONNX Runtime cannot load it: {exc}"
        ) from exc
    names = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
    if names != (spec.inputs, spec.graph_outputs):
        raise ValueError(
            f"{directory / spec.model_file}: graph inputs/outputs {names} differ "
            f"from bundle.json {(spec.inputs, spec.graph_outputs)}"
        )
    for output, head in spec.heads.items():
        try:
            head_session = ort.InferenceSession(
                str(directory / head.file), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own exception types
            raise ValueError(
                f"{directory / head.file}: ONNX Runtime cannot load it: {exc}"
            ) from exc
        head_names = (
            [i.name for i in head_session.get_inputs()],
            [o.name for o in head_session.get_outputs()],
        )
        if head_names != ([head.input, "attention_mask"], [output]):
            raise ValueError(
                f"{directory / head.file}: head inputs/outputs {head_names} differ from "
                f"bundle.json {([head.input, 'attention_mask'], [output])}"
            )
    tok = Tokenizer.from_file(str(directory / spec.tokenizer.file))
    mask = tok.token_to_id(spec.tokenizer.mask_token)
    if mask != spec.tokenizer.mask_id:
        raise ValueError(
            f"{directory / spec.tokenizer.file}: {spec.tokenizer.mask_token} is not id "
            f"{spec.tokenizer.mask_id} as bundle.json says"
        )
    for name in ("pad", "unk", "cls", "sep"):
        if tok.id_to_token(getattr(spec.tokenizer, f"{name}_id")) is None:
            raise ValueError(
                f"{directory / spec.tokenizer.file}: has no id "
                f"{getattr(spec.tokenizer, f'{name}_id')} ({name}, as bundle.json says)"
            )
    report: dict[str, Any] = {
        "bundle": str(directory),
        "tasks": spec.tasks,
        "precision": spec.precision,
    }
    source = Path(spec.source.checkpoint)
    try:
        if not source.is_dir():  # exported from an installed package
            source = resolve_init(spec.source.checkpoint)[0]
        same = sha256(weights_path(source)) == spec.source.sha256
    except ValueError:
        same = False
    if not same:  # the file is the exporter's (sha256 above): its parity then is recorded
        report["parity"] = spec.export_parity or "not recorded: re-export the bundle"
        report["parity_checked"] = "at export (source checkpoint not at hand)"
        return report
    model = load_model(source, spec.source.architecture).eval()
    tokenizer = bundle_tokenizer(directory, spec)
    colbert = read_colbert(source, tokenizer.tokenizer) if "multivector" in spec.tasks else None
    result = torch_parity(
        model,
        spec.tasks,
        tokenizer,
        directory / spec.model_file,
        spec.inputs,
        spec.outputs,
        spec.max_seq_len,
        spec.pooling.model_dump() if spec.pooling else None,
        spec.sparse.model_dump() if spec.sparse else None,
        colbert.projection if colbert is not None else None,
        {output: directory / head.file for output, head in spec.heads.items()},
    )
    gate = MIN_AGREEMENT[spec.precision]
    result["agreement_p_value"] = agreement_p_value(
        result["top1_agreement"], result["compared"], gate
    )
    if (
        result["max_abs_diff"] > TOLERANCE[spec.precision]
        or result["agreement_p_value"] < VERIFY_ALPHA
    ):
        raise ValueError(
            f"{directory}: {spec.precision} parity with {source} fails: {result} "
            f"(tolerance {TOLERANCE[spec.precision]}; a graph at the agreement gate {gate} "
            f"disagrees this often with probability {result['agreement_p_value']:.2g}, "
            f"under {VERIFY_ALPHA})"
        )
    report["parity"] = result
    if spec.variant_accuracy:  # the rate, measured at export on real text
        report["variant_accuracy"] = spec.variant_accuracy
    return report


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
