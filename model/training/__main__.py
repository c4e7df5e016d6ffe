"""`python -m model.training {pretrain} ...`: the commands that reproduce the shipped weights."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.training", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    pre = commands.add_parser("pretrain", help="MLM + NSP pre-training from a Wikipedia dump")
    pre.add_argument("--recipe", required=True, help="recipe name (cpu, gpu, tiny) or .toml path")
    pre.add_argument("--data", required=True, type=Path, help="WikiExtractor text directory")
    pre.add_argument("--out", required=True, type=Path, help="output (and resume) directory")
    pre.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many optimizer steps in total (resume later)",
    )

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from model.training.recipe import Recipe

    try:
        recipe = Recipe.load(args.recipe)
        if not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        if args.command == "pretrain":
            from model.training.pretrain import pretrain

            pretrain(recipe, args.data, args.out, args.stop_after)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
