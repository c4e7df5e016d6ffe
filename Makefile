# The README's commands. Each target creates or refreshes the local virtualenv it needs, so one
# command sets up a fresh machine. `onnxruntime` (cpu) and `onnxruntime-gpu` never share a venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,train,dev
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
comma := ,

.PHONY: help install test lint format serve clean

help:
	@echo "make test    lint and run the test suite (creates $(VENV) on first use)"
	@echo "make serve   serve the shipped bundles in bundles/ on port 8000"
	@echo "make lint    ruff check + format check"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy service

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest

# Serving needs only the cpu extra (no torch): a fresh clone installs that much and serves.
SERVE_STAMP := $(VENV)/.installed-serve
$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu]"
	touch $@

serve: $(SERVE_STAMP)
	@if ! ls bundles/*/bundle.json >/dev/null 2>&1; then \
		echo "no bundles: bundles/ holds no servable model"; exit 1; fi
	$(PY) -m service --bundles bundles --host $${BERTSERVE_HOST:-0.0.0.0} --port $${BERTSERVE_PORT:-8000}

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
