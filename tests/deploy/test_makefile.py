"""The Makefile's interpreter: PYTHON if given, else the newest supported python3.1x on PATH
that runs; otherwise one line that says what to install. Checked on a fake PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check-python.sh"


def fake(bin_dir: Path, name: str, version: str | None) -> None:
    """A `python3.x` that prints its version and has venv, or (version None) a pyenv-like shim
    that fails."""
    script = bin_dir / name
    if version is None:
        script.write_text("#!/bin/sh\necho 'pyenv: command not found' >&2\nexit 127\n")
    else:
        script.write_text(f'#!/bin/sh\ncase "$*" in *version_info*) echo {version};; esac\n')
    script.chmod(0o755)


def only(bin_dir: Path) -> str:
    """A PATH of the fakes alone, plus the shell tools make and the script use (this machine's
    /usr/bin has a real python3.11)."""
    for tool in ("bash", "sh", "echo"):
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    return str(bin_dir)


def run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": only(bin_dir)}
    return subprocess.run(
        ["bash", str(CHECK), *args], capture_output=True, text=True, env=env, check=False
    )


def make_python(bin_dir: Path) -> str:
    env = {**os.environ, "PATH": only(bin_dir)}
    for name in ("PYTHON", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # `make test PYTHON=...` sets them
        env.pop(name, None)
    out = subprocess.run(
        [
            shutil.which("make") or "make",
            "-s",
            "-C",
            str(ROOT),
            "--eval",
            "show:\n\t@echo $(PYTHON)",
            "show",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return out.stdout.strip()


def test_newest_that_runs_wins(tmp_path):
    fake(tmp_path, "python3.11", "3.11")
    fake(tmp_path, "python3.12", "3.12")
    fake(tmp_path, "python3.13", None)  # a shim of a version that is not selected
    assert run(tmp_path, "--find").stdout.strip() == str(tmp_path / "python3.12")
    assert make_python(tmp_path) == str(tmp_path / "python3.12")
    assert run(tmp_path, str(tmp_path / "python3.12")).returncode == 0


def test_none_found_says_what_to_install(tmp_path):
    assert run(tmp_path, "--find").stdout == ""
    result = run(tmp_path, "")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "apt-get install python3.12-venv" in result.stderr


def test_unsupported_or_broken_python_is_refused_in_one_line(tmp_path):
    fake(tmp_path, "python3.10", "3.10")
    fake(tmp_path, "python3.12", None)
    old = run(tmp_path, "python3.10")
    assert old.returncode == 1 and "is Python 3.10" in old.stderr
    broken = run(tmp_path, "python3.12")
    assert broken.returncode == 1 and "does not run" in broken.stderr
    missing = run(tmp_path, "python3.99")
    assert missing.returncode == 1 and "not an executable" in missing.stderr
