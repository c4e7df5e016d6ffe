"""Live traffic first: priorities, deadlines and shares under mixed load.

What the experiments here share: the arguments of one server of one bundle (`parser`), and
the SST-2 sentences they send (`sentences`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.inputs import write_bodies


def parser(doc: str, port: int, work: str) -> argparse.ArgumentParser:
    """The arguments every experiment here takes: --bundle, --data, --port, --work, --report,
    --env (KEY=VALUE for the server; `env(args)` reads them)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/minilm-embed"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--work", type=Path, default=Path(work))
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)"
    )
    return parser


def env(args: argparse.Namespace) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.env)


def sentences(args: argparse.Namespace) -> list[str]:
    """SST-2 dev sentences (bench.inputs' classify bodies), written under --work."""
    single = write_bodies("classify", args.data, args.work / "inputs")
    return [json.loads(line)["inputs"] for line in single.read_text().splitlines() if line]
