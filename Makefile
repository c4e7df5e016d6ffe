# The README's commands. Each target creates or refreshes the local virtualenv it needs, so one
# command sets up a fresh machine. `onnxruntime` (cpu) and `onnxruntime-gpu` never share a venv.
# The interpreter: PYTHON if given, else the newest supported python3.1x on PATH that runs (a
# pyenv shim for a version that is not selected is on PATH and fails).
PYTHON ?= $(shell bash tools/check-python.sh --find)
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,train,dev
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: help check-python install install-serve test lint format serve clean pretrained finetuned \
	models bench reliability image-test

help:
	@echo "make test    lint and run the test suite (creates $(VENV) on first use)"
	@echo "make serve   serve the shipped bundles in bundles/ on port 8000"
	@echo "make lint    ruff check + format check"
	@echo "make bench   bertserve vs the raw ceiling and the peers -> docs/benchmarks.md (~10 min)"
	@echo "make reliability  overload, faults, hostile input -> docs/reliability.md (~4 min)"

# One line that says what is missing, instead of "python3.11: command not found".
check-python:
	@test -x $(PY) || bash tools/check-python.sh "$(PYTHON)"

$(STAMP): pyproject.toml | check-python
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
$(SERVE_STAMP): pyproject.toml | check-python
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu]"
	touch $@

install-serve: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	@if ! ls bundles/*/bundle.json >/dev/null 2>&1; then \
		echo "no bundles: bundles/ holds no servable model"; exit 1; fi
	$(VENV)/bin/bertserve serve --bundles bundles --host $${BERTSERVE_HOST:-127.0.0.1} \
		--port $${BERTSERVE_PORT:-8000}

# Build and run the CPU image and the compose stack for real (tools/image-test.sh): a container
# engine is started if none answers; without one it is skipped, never failed.
image-test: $(STAMP)
	PY=$(PY) bash tools/image-test.sh

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .ruff_cache

# --- benchmarks (bench/): the peers' dependencies live in a virtualenv of their own ------------
BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
$(BENCH_STAMP): pyproject.toml
	@command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk"; exit 1; }
	@test -x $(BENCH_VENV)/bin/python || bash tools/check-python.sh "$(PYTHON)"
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet -e ".[cpu,train,dev,bench]"
	touch $@

bench: $(BENCH_STAMP)  ## docs/benchmarks.md + docs/img/bench-*.png
	$(BENCH_VENV)/bin/python -m bench.run --data $(DATA)

reliability: $(BENCH_STAMP)  ## docs/reliability.md
	$(BENCH_VENV)/bin/python -m bench.reliability --data $(DATA)

# --- reproducing the shipped weights (the data sets live outside the repo) ---------------------
DATA ?= ../shared/data
PRETRAINED := checkpoints/pretrained-wiki-tiny
CHECKPOINT_FILES := config.json model.safetensors tokenizer.json vocab.txt eval.json curves.png \
	metrics.jsonl recipe.json

pretrained: $(STAMP)  ## the pre-trained checkpoint and its fill-mask/nsp bundle (~2 h, 2 cores)
	$(PY) -m model.training pretrain --recipe cpu --data $(DATA)/wikipedia-en-2015/text \
		--out runs/pretrain-cpu
	mkdir -p $(PRETRAINED)
	cd runs/pretrain-cpu && cp $(CHECKPOINT_FILES) $(CURDIR)/$(PRETRAINED)/
	$(PY) -m export --checkpoint $(PRETRAINED) --task fill-mask --max-seq-len 128 \
		--out bundles/pretrained-wiki-tiny
	$(PY) -m model.training evaluate --task nsp --bundle bundles/pretrained-wiki-tiny \
		--data $(DATA)/wikipedia-en-2015/text --record
	$(PY) -m model.training evaluate --task mlm --bundle bundles/pretrained-wiki-tiny \
		--data $(DATA)/wikipedia-en-2015/text --record
	$(PY) -m export verify bundles/pretrained-wiki-tiny

# One fine-tuned bundle: make finetuned TASK=classify SET=sst2 NAME=sst2-classify [MAXLEN=256]
finetuned: $(STAMP)
	$(PY) -m model.training finetune --task $(TASK) --init $(PRETRAINED) --data $(DATA)/$(SET) \
		--out runs/ft-$(NAME)
	$(PY) -m export --checkpoint runs/ft-$(NAME) --task $(TASK) --out bundles/$(NAME) \
		$(if $(MAXLEN),--max-seq-len $(MAXLEN))
	$(PY) -m model.training evaluate --task $(TASK) --bundle bundles/$(NAME) --data $(DATA)/$(SET) \
		--record
	$(PY) -m export verify bundles/$(NAME)

models: pretrained  ## the whole chain, data to bundles
	$(MAKE) finetuned TASK=classify SET=sst2 NAME=sst2-classify
	$(MAKE) finetuned TASK=ner SET=conll2003 NAME=conll-ner
	$(MAKE) finetuned TASK=qa SET=squad-v1.1 NAME=squad-qa MAXLEN=256  # fine-tuned at 256
