#!/usr/bin/env bash
# `check-python.sh --find`: print the newest supported Python on PATH that runs (or nothing).
# `check-python.sh PYTHON`: is it one bertserve supports (3.11-3.13, with venv)? One line that
# says what to do if not; the Makefile calls it before creating a virtualenv.
set -u
if [ "${1:-}" = "--find" ]; then
    for version in 3.13 3.12 3.11; do
        candidate=$(command -v "python$version" 2>/dev/null) || continue
        if "$candidate" -c 'import ensurepip, venv' >/dev/null 2>&1; then
            echo "$candidate"
            exit 0
        fi
    done
    exit 0
fi
python=${1:-}
need="bertserve needs Python 3.11, 3.12 or 3.13 with venv"
if [ -z "$python" ]; then
    echo "error: $need: none of python3.13, python3.12, python3.11 on PATH runs;" \
        "install one (Debian/Ubuntu: apt-get install python3.12-venv) or run make PYTHON=/path/to/python3.1x" >&2
    exit 1
fi
if ! command -v "$python" >/dev/null 2>&1; then
    echo "error: $need: PYTHON=$python is not an executable on PATH" >&2
    exit 1
fi
if ! version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    echo "error: $need: $python does not run (a pyenv shim of a version not selected?); run make PYTHON=/path/to/python3.1x" >&2
    exit 1
fi
case "$version" in
    3.11 | 3.12 | 3.13) ;;
    *)
        echo "error: $need: $python is Python ${version:-of unknown version}; run make PYTHON=python3.12 (or 3.11, 3.13)" >&2
        exit 1
        ;;
esac
if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    echo "error: $need: $python $version lacks venv/ensurepip (Debian/Ubuntu: apt-get install python$version-venv)" >&2
    exit 1
fi
