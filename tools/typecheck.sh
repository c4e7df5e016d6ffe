#!/usr/bin/env bash
# mypy over the installed names. The package installs as `bertserve.*` from the repository's
# top-level folders (pyproject.toml's package-dir), a mapping that mypy does not read: it gets
# the same tree as links under runs/typecheck/ (rebuilt each time, so new modules count), and
# checks `bertserve` there and bench/ beside it. Paths in its messages read
# runs/typecheck/bertserve/<folder>/...: the file is <folder>/... at the top.
set -euo pipefail
MYPY=${1:-mypy}
cd "$(dirname "$0")/.."
TREE=runs/typecheck
rm -rf "$TREE"
mkdir -p "$TREE/bertserve"
for f in bertserve/*.py; do ln -s "$PWD/$f" "$TREE/$f"; done
for pkg in export model runtime service; do ln -s "$PWD/$pkg" "$TREE/bertserve/$pkg"; done
MYPYPATH="$TREE" "$MYPY" -p bertserve -p bench
