"""Settings from one source: the fields of service/settings.py make the flags of `bertserve
serve`, its --help and docs/api.md's table; nothing restates them by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bertserve.service.__main__ import main
from bertserve.service.settings import GROUPS, Settings, env_name, flag_of, is_secret

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_described_and_in_exactly_one_group():
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(Settings.model_fields)
    assert len(grouped) == len(set(grouped))
    assert not [n for n, f in Settings.model_fields.items() if not (f.description or "").strip()]


def test_help_lists_every_setting_in_its_group(capsys):
    with pytest.raises(SystemExit):
        main(["--help"], prog="bertserve serve")
    text = capsys.readouterr().out
    for group, names in GROUPS.items():
        at = text.index(f"\n{group}:")
        for name in names:
            shown = env_name(name)
            assert text.index(shown, at) > at, name
            if not is_secret(name):
                assert flag_of(name) in text, name
    for name in ("api_keys", "metrics_token"):
        assert flag_of(name) not in text  # keys stay off the command line


def test_the_docs_table_is_generated_from_the_fields():
    run = subprocess.run(
        [sys.executable, "tools/docs.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    table = (ROOT / "docs" / "api.md").read_text()
    for name, field in Settings.model_fields.items():
        assert f"| `{env_name(name)}` |" in table
        assert (field.description or "").split(";")[0].replace("|", "\\|") in table


def test_flags_set_settings_and_win_over_the_environment(monkeypatch, tmp_path):
    """The parser hands only the flags given to Settings: the environment, then the field's
    default, fill in the rest."""
    import argparse

    from bertserve.service.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("BERTSERVE_MAX_IN_FLIGHT", "7")
    monkeypatch.setenv("BERTSERVE_MAX_RECEIVING", "9")
    args = parser.parse_args(
        ["--bundles", str(tmp_path), "--max-in-flight", "3", "--no-split-batches"]
    )
    settings = Settings(**vars(args))
    assert settings.max_in_flight == 3 and settings.max_receiving == 9
    assert settings.split_batches is False and settings.keep_alive_s == 75.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-arena", "huge"])


def test_a_bad_value_is_one_line_naming_the_variable(capsys, tmp_path):
    assert main(["--bundles", str(tmp_path), "--max-batch-rows", "0"]) == 2
    assert "BERTSERVE_MAX_BATCH_ROWS" in capsys.readouterr().err
