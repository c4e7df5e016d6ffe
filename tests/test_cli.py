"""The `bertserve` command: every subcommand listed and documented with an example, user
mistakes in one line with exit status 2, and the ready line of a real server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bertserve.cli import COMMANDS, main

BIN = Path(sys.executable).parent
SUBCOMMANDS = (
    "serve",
    "export",
    "verify",
    "convert",
    "calibrate",
    "checkpoint",
    "pretrain",
    "finetune",
    "distil",
    "shrink",
    "rerank",
    "splade",
    "colbert",
    "soup",
    "evaluate",
    "bench",
)


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in out
    assert set(COMMANDS) == set(SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"bench"}))
def test_every_subcommand_has_help_with_an_example(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: bertserve {name}")
    assert "example" in out and f"bertserve {name} " in out.split("example")[1]


def test_user_mistakes_are_one_line_and_exit_2(capsys, tmp_path):
    assert main(["nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "bundle.json" in err


def test_console_script_and_module_forms_are_installed():
    for command in ([str(BIN / "bertserve"), "--help"], [sys.executable, "-m", "bertserve"]):
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        assert "distil" in out
    legacy = subprocess.run(
        [sys.executable, "-m", "bertserve.service", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert legacy.stdout.startswith("usage: python -m bertserve.service")


@pytest.mark.slow
def test_ready_line_names_the_real_port_models_and_provider(bundle_dir):
    """Off a terminal, one structured log line: port 0 resolved to the port really bound."""
    process = subprocess.Popen(
        [str(BIN / "bertserve"), "serve", "--bundles", str(bundle_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"BERTSERVE_INTRA_OP_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    try:
        deadline = time.monotonic() + 60
        facts = None
        while facts is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "the server exited before it was ready"
            record = json.loads(line)
            if record.get("event") == "ready":
                facts = record
        assert facts is not None
        port = int(facts["url"].rsplit(":", 1)[1])
        assert port > 0 and facts["docs"] == f"{facts['url']}/docs"
        assert httpx.get(f"{facts['url']}/health/ready").status_code == 200
        assert facts["models"] == {
            "fill-mask": ["pretrained"],
            "nsp": ["pretrained"],
            "ner": ["entities"],
            "classify": ["sentiment"],
            "qa": ["squad"],
        }
        assert facts["providers"] == ["CPUExecutionProvider"]
        assert facts["example"].startswith(f"curl -s {facts['url']}/classify ")
    finally:
        process.terminate()
        # Read what it writes while it stops: a server blocked on a full pipe never exits.
        process.communicate(timeout=30)


def test_ready_text_for_people():
    from bertserve.service.process.server import ready_text

    text = ready_text(
        {
            "url": "http://127.0.0.1:8000",
            "listening": "0.0.0.0:8000",
            "docs": "http://127.0.0.1:8000/docs",
            "providers": ["CPUExecutionProvider"],
            "models": {"classify": ["sst2-minilm", "sst2-tiny"], "qa": ["squad-minilm"]},
            "example": "curl -s http://127.0.0.1:8000/classify",
        }
    )
    assert text.splitlines()[0] == (
        "bertserve is ready at http://127.0.0.1:8000 (listening on 0.0.0.0:8000)"
    )
    assert "  classify  sst2-minilm (default), sst2-tiny (?model=NAME)" in text
    assert "  qa        squad-minilm (default)" in text
    assert "  try       curl -s http://127.0.0.1:8000/classify" in text


def test_a_missing_extra_met_inside_a_command_is_one_line(monkeypatch):
    """The commands import torch where they need it: a serving install (no torch) running
    `bertserve export` gets the extra to install, not a traceback."""
    import bertserve.export.__main__ as export_main

    def needs_torch(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(export_main, "main", needs_torch)
    with pytest.raises(SystemExit) as stopped:
        main(["export", "--checkpoint", "x", "--task", "classify", "--out", "y"])
    assert str(stopped.value) == (
        "error: bertserve export needs 'torch': pip install -c constraints.txt 'bertserve[train]'"
    )
