"""The project speaks in the present tense: no numbered work sessions anywhere in it (history is
in git and CHANGELOG.md, by date), and the README's status table stays a table of one-liners
that link to the docs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SESSION = re.compile(r"\bsession[- _]?\d+\b", re.IGNORECASE)
TEXT = {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".sh", ".cfg", ".ini", ".json", ""}


def tracked() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.splitlines() if Path(name).suffix in TEXT]


def test_no_tracked_file_names_a_work_session():
    found = []
    for path in tracked():
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in SESSION.finditer(text)]
    assert found == [], "say a date or a commit hash instead: " + "; ".join(found[:10])


def test_readme_table_cells_are_one_liners():
    long = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("|"):
            long += [cell.strip()[:60] for cell in line.split("|") if len(cell.strip()) > 300]
    assert long == [], f"README table cells over 300 characters: {long}"
