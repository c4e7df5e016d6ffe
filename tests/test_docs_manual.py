"""The docs as a manual: the serving path in docs/architecture.md names code that exists, the
architecture holds no measured figure, and every docs/...md#anchor cited anywhere resolves."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "docs" / "architecture.md"
# A measured figure: a number with a unit of time, rate, size or a ratio ("4.3 ms", "546 req/s",
# "1.6x", "140 MB"). Settings' values are written as settings (`max_wait_ms`), not figures.
FIGURE = re.compile(r"\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ms|us|µs|req/s|MiB|GiB|MB|kB|x)\b")
SETTING_VALUES = {"10 ms", "1 ms"}  # LoneCost.INLINE_S, the one-off hang drill's limit


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    keep = (".py", ".md", ".toml", ".yml", ".yaml", ".sh", "Makefile", "Dockerfile")
    return [ROOT / f for f in out.split() if f.endswith(keep) and "CHANGELOG" not in f]


def test_every_cited_doc_anchor_resolves():
    broken = []
    for path in tracked():
        if not path.is_file():
            continue
        for m in re.finditer(r"docs/(\w[\w/.-]*\.md)#([\w-]+)", path.read_text(encoding="utf-8")):
            doc = ROOT / "docs" / m.group(1)
            if not doc.is_file() or m.group(2) not in anchors(doc):
                broken.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not broken, "citations of sections that do not exist:\n" + "\n".join(broken)


def test_every_cited_doc_exists():
    missing = []
    for path in tracked():
        if not path.is_file():
            continue
        for m in re.finditer(
            r"(?<![\w/.])docs/(\w[\w/.-]*\.md)\b", path.read_text(encoding="utf-8")
        ):
            if not (ROOT / "docs" / m.group(1)).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "\n".join(missing)


def test_the_architecture_holds_no_measured_figure():
    text = re.sub(r"```.*?```", "", ARCH.read_text(encoding="utf-8"), flags=re.DOTALL)
    found = {m.group(0) for m in FIGURE.finditer(text)} - SETTING_VALUES
    assert not found, f"figures belong in a report: {sorted(found)}"


def test_the_serving_path_names_code_that_exists():
    text = ARCH.read_text(encoding="utf-8")
    section = text[text.index("## Serving path") : text.index("## Process topology")]
    steps = re.findall(r"`((?:service|runtime)/[\w/]+)\.py: ([\w.]+)`", section)
    assert len(steps) >= 10
    for path, name in steps:
        module = importlib.import_module("bertserve." + path.replace("/", "."))
        target = module
        for part in name.split("."):
            assert hasattr(target, part), f"{path}.py has no {name}"
            target = getattr(target, part)
