"""What the retrieval benches share: a head's route against /embed on the same encoder, in one
server, the routes alternating first each round, at each level of connections and kind of body;
the table of the best rounds, and the report around them."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.loadgen import closed_loop
from bench.run import measured_with
from bench.servers import Server

SETTLE_S = 3
Runs = dict[tuple[str, str, int], list[dict]]


def add_load_arguments(parser: argparse.ArgumentParser, port: int, work: str) -> None:
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squad-v1.1"))
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--work", type=Path, default=Path(work))
    parser.add_argument("--report", type=Path, default=None)


def alternate(
    server: Server,
    models: dict[str, str],
    body: Callable[[str, str], Path],
    kinds: list[str],
    args: argparse.Namespace,
) -> Runs:
    """Each round, each kind of body, each level: every route of `models` (route -> the model
    it is asked for) loaded for `args.seconds`, the first route alternating each round;
    `body(kind, route)`: that route's file of bodies. Exits at any status but 200."""
    levels = [int(x) for x in args.levels.split(",")]
    runs: Runs = {}
    for round_ in range(args.rounds):
        order = list(models) if round_ % 2 == 0 else list(models)[::-1]
        for kind in kinds:
            for level in levels:
                for route in order:
                    url = f"{server.base}{route}?model={models[route]}"
                    path = body(kind, route)
                    closed_loop(url, path, 1, 2)  # warm this route and shape
                    time.sleep(SETTLE_S)
                    load = closed_loop(url, path, level, args.seconds)
                    if set(load.statuses) != {"200"}:
                        raise SystemExit(f"{route} answered {load.statuses}: see the log")
                    runs.setdefault((kind, route, level), []).append(load.to_dict())
                    line = {"round": round_, "kind": kind, "route": route, "level": level}
                    print(json.dumps(line | {"req_s": load.throughput, "p50_ms": load.p50_ms}))
    return runs


def ratio_table(
    runs: Runs, kinds: list[str], args: argparse.Namespace, base: str, route: str, short: str
) -> list[str]:
    """The Markdown table, `route` against `base` by the best round of each: `short` names
    `route` in the ratio's and the latencies' headers."""
    lines = [
        f"| body | connections | {base} req/s | {route} req/s | {short} / dense | "
        f"p50, dense / {short} |",
        "|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        for level in (int(x) for x in args.levels.split(",")):
            best = {r: max(x["throughput"] for x in runs[(kind, r, level)]) for r in (base, route)}
            p50 = {r: min(x["p50_ms"] for x in runs[(kind, r, level)]) for r in (base, route)}
            lines.append(
                f"| {kind} | {level} | {best[base]:.1f} | {best[route]:.1f} | "
                f"{best[route] / best[base]:.2f}x | {p50[base]:.1f} / {p50[route]:.1f} ms |"
            )
    return lines


def statuses(runs: Runs) -> list[str]:
    return sorted({s for v in runs.values() for x in v for s in x["statuses"]})


def report(
    title: str,
    command: str,
    args: argparse.Namespace,
    setup: str,
    table: list[str],
    runs: Runs,
    after: Sequence[str] = (),
) -> None:
    """Print the report (its title, when and how it was measured, `setup`, the table, the
    statuses seen, then `after`) and write it to --report if given."""
    text = "\n".join(
        [
            f"# {title}",
            "",
            f"{measured_on(command, args)}: {setup}",
            "",
            *table,
            "",
            f"Statuses seen: {statuses(runs)}.",
            "",
            *after,
        ]
    )
    print(text)
    if args.report:
        args.report.write_text(text)


def measured_on(command: str, args: argparse.Namespace) -> str:
    """The report's first sentence, up to the colon: when, at which commit, on what, by what."""
    return measured_with(
        f"{command} --levels {args.levels} --rounds {args.rounds} --seconds {args.seconds:g}"
    )
