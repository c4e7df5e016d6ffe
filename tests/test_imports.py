"""The layering that docs/architecture.md draws, enforced: which package may import which, and
no import cycle among the modules, function-level imports included (those under
`if TYPE_CHECKING:` are types only, and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each folder and the import name it installs as (pyproject.toml's package-dir); bench/ is a
# checkout's tool and installs as itself.
PACKAGES = {
    "runtime": "bertserve.runtime",
    "model": "bertserve.model",
    "export": "bertserve.export",
    "service": "bertserve.service",
    "bertserve": "bertserve",
    "bench": "bench",
}
# Who may import whom (besides itself). model/training is the training subpackage: it may use
# the runtime to evaluate exactly what is served; the rest of model/ uses nothing of ours.
ALLOWED = {
    "runtime": set(),
    "model": set(),
    "model.training": {"model", "runtime"},
    "export": {"model", "runtime"},
    "service": {"runtime"},
    "bertserve": {"runtime", "model", "export", "service"},
    "bench": {"runtime", "model", "model.training", "export", "service"},
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = (*name.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours `name` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def layer(name: str) -> str:
    """The layer of a module: its folder (`bertserve.service.http.app` -> "service"), with
    model.training apart from the rest of model/."""
    parts = name.split(".")
    if parts[0] == "bertserve" and len(parts) > 1 and parts[1] in PACKAGES:
        parts = parts[1:]
    if parts[:2] == ["model", "training"]:
        return "model.training"
    return parts[0]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for name, targets in graph().items():
        mine = layer(name)
        for target in targets:
            theirs = layer(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])
