"""What `pip install .` puts in an environment: one import name, `bertserve`, over the
repository's top-level folders, and folders a reader can take in at a glance."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("bertserve", "export", "model", "runtime", "service")
MAX_FLAT = 15  # modules in one folder, the way TEI, vLLM and Infinity keep theirs


def configured() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def installed_name(folder: Path) -> str:
    top, *rest = folder.relative_to(ROOT).parts
    return ".".join(["bertserve", *rest] if top == "bertserve" else ["bertserve", top, *rest])


def test_the_package_list_is_every_folder_that_holds_code():
    folders = {
        installed_name(init.parent) for top in FOLDERS for init in (ROOT / top).rglob("__init__.py")
    }
    data_only = {"bertserve.model.training.recipes"}
    assert set(configured()["packages"]) == folders | data_only


def test_from_outside_the_checkout_only_bertserve_imports(tmp_path):
    """Run where the checkout is not on sys.path: the installed names import, and the folder
    names that would collide with anything else called `model` or `service` do not."""
    script = (
        "import importlib, importlib.util\n"
        "for name in ('bertserve.model.bert', 'bertserve.export.graph', "
        "'bertserve.runtime.engine', 'bertserve.service.http.app', "
        "'bertserve.model.training.recipe'):\n"
        "    importlib.import_module(name)\n"
        "print(sorted(n for n in ('model', 'export', 'runtime', 'service', 'bench') "
        "if importlib.util.find_spec(n) is not None))\n"
    )
    run = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_no_folder_holds_more_than_fifteen_modules_flat():
    crowded = {}
    for top in (*FOLDERS, "bench", "tests"):
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts or "fixtures" in folder.parts:
                continue
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_FLAT:
                crowded[str(folder.relative_to(ROOT))] = count
    assert not crowded, f"more than {MAX_FLAT} modules flat: {crowded}"
