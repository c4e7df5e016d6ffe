"""bench/ as one tool: every module is reachable from `bertserve bench MODE`, every mode
answers --help, and every bench target of the Makefile calls a mode with flags it takes."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.__main__ import MODES, main
from tests.test_imports import graph, modules

ROOT = Path(__file__).resolve().parents[2]
TARGETS = (
    "bench",
    "reliability",
    "bench-families",
    "bench-infinity",
    "bench-minilm",
    "reliability-minilm",
)


def started(module: str, source: str) -> bool:
    """Whether `source` names `module`, dotted or as its file."""
    path = module.replace(".", "/") + ".py"
    return bool(re.search(rf"\b{re.escape(module)}\b", source)) or path in source


def test_every_bench_module_is_reachable_from_a_mode():
    """Reachable: a mode, or imported by a reachable module, or started by one by its name
    (the peers run as `python -m bench.peers.NAME`)."""
    edges, known = graph(), modules()
    bench = {name for name in known if name.split(".")[0] == "bench"}
    makefile = (ROOT / "Makefile").read_text()
    reached = {m.module for m in MODES.values()} | {"bench", "bench.__main__"}
    reached |= {b for b in bench if started(b, makefile)}
    frontier = list(reached)
    while frontier:
        name = frontier.pop()
        source = known[name].read_text(encoding="utf-8") if name in known else ""
        named = {b for b in bench if started(b, source)}
        for nxt in (edges.get(name, set()) | named) - reached:
            reached.add(nxt)
            frontier.append(nxt)
    assert bench - reached == set(), "modules nothing runs: delete them or make them a mode"


def test_the_mode_list_is_the_help(capsys):
    assert main(["--help"], prog="bertserve bench") == 0
    out = capsys.readouterr().out
    for name in MODES:
        assert f"  {name} " in out
    assert main(["nope"]) == 2


@pytest.mark.slow
def test_every_mode_answers_help():
    """In one process: the modes import (their dependencies are the dev and train extras) and
    parse their flags under the name the user typed."""
    failed = {}
    for name in MODES:
        try:
            main([name, "--help"], prog="bertserve bench")
        except SystemExit as exc:
            if exc.code not in (0, None):
                failed[name] = exc.code
        except Exception as exc:  # an import or a parser that fails
            failed[name] = repr(exc)
    assert not failed


def make_dry(target: str) -> list[list[str]]:
    """The `bertserve bench` command lines `make -n TARGET` would run."""
    out = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, "PYTHON=python3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.replace("\\\n", " ")
    return [
        shlex.split(line[line.index("bertserve bench") :])
        for line in out.splitlines()
        if "bertserve bench " in line
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target", TARGETS)
def test_makefile_bench_targets_call_a_mode_with_flags_it_takes(target, capsys):
    calls = make_dry(target)
    assert calls, f"make {target} runs no `bertserve bench` mode"
    for call in calls:
        mode = call[2]
        assert mode in MODES, call
        with pytest.raises(SystemExit):
            main([mode, "--help"], prog="bertserve bench")
        help_text = capsys.readouterr().out
        for flag in (a.split("=")[0] for a in call[3:] if a.startswith("--")):
            assert flag in help_text, f"make {target}: {mode} takes no {flag}"


def test_make_bench_drives_only_the_classify_peers():
    """`make bench` drives every server of PEERS on /classify: the rerank peer there broke it
    (its start-up never answered /classify). The /classify peers are the ones bench/peers'
    docstring lists."""
    import bench.peers
    from bench.servers import PEERS, PROBES

    listed = set(re.findall(r"- `(\w+)`:", bench.peers.__doc__ or ""))
    assert {module.rsplit(".", 1)[1] for module in PEERS.values()} == listed
    assert "cross-encoder" in PROBES
