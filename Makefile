# hf_apex developer commands. `make help` lists them.
PYTHON ?= python3
# torch for machines that have none yet: the version CI pins (its machines take a CPU build). A CUDA machine should
# bring its own torch (the one apex is built against).
TORCH_VERSION ?= 2.13.0
# OFFLINE=1: install hf_apex without resolving dependencies (machines with no package index).
OFFLINE ?=
APEX_SRC ?=
APEX_COMMIT ?= 6424da3b4faa6c8f062da4a48c424fff3f02d42d
APEX_PARALLEL_BUILD ?= $(shell nproc)
# make apex APEX_EXTENSIONS=hf_apex: compile only the extensions hf_apex loads (amp_C, fused_layer_norm_cuda)
APEX_EXTENSIONS ?= all
PYTEST_ARGS ?=
# make test-lowest: the CPU suite in a venv of its own at pyproject.toml's lower bounds (.ci/lowest.txt), on the lowest
# Python requires-python allows (pyenv's 3.10 where there is one; LOWEST_PYTHON=... names another). The venv is kept
# between runs; delete LOWEST_VENV to start clean. (wheel: the bdist_wheel that make apex's test needs; Python 3.10's
# setuptools lacks it.)
LOWEST_VENV ?= .deps/venv-lowest
LOWEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) \
  $(shell python3.10 -c "import sys; print(sys.executable)" 2>/dev/null))
# make bench: models, stages, steps and batch sizes (BENCH_BATCH="bert=64 gpt2=8"); empty = the defaults of
# recipes/bench.py. CUDA: bert gpt2 llama x all eight stages, 10 warm-up + 60 timed steps (FP32 stages: 20; BERT's
# BF16 stages: 3 runs of 100; GPT-2's and Llama's fused_full, torch_fused and auto: 3 runs), BERT 128x128,
# GPT-2/Llama 16x1024. CPU: tiny bert and gpt2 x the seed's four stages.
BENCH_MODELS ?=
BENCH_STAGES ?=
# BENCH_NPROC=2: each run on 2 GPUs with DDP (torchrun), same per-device batch; BENCH_NPROC="1 2": both, with scaling
BENCH_NPROC ?=
BENCH_STEPS ?=
# BENCH_REPEATS=3: every row run 3 times (fresh processes, in rounds); default: 3 for the rows above, else 1
BENCH_REPEATS ?=
BENCH_WARMUP ?=
BENCH_BATCH ?=
BENCH_DIR ?= .bench
# BENCH_RESULTS=benchmarks/results.csv: also append the table's rows to the results table (benchmarks/README.md)
BENCH_RESULTS ?=
BENCH_ARGS ?=

# the flags of recipes/bench.py that the BENCH_* variables set (one line when make echoes the command)
BENCH_FLAGS = --out_dir $(BENCH_DIR) $(if $(BENCH_MODELS),--models $(BENCH_MODELS)) \
  $(if $(BENCH_STAGES),--stages $(BENCH_STAGES)) $(if $(BENCH_NPROC),--nproc $(BENCH_NPROC)) \
  $(if $(BENCH_STEPS),--steps $(BENCH_STEPS)) $(if $(BENCH_WARMUP),--warmup $(BENCH_WARMUP)) \
  $(if $(BENCH_REPEATS),--repeats $(BENCH_REPEATS)) $(foreach b,$(BENCH_BATCH),--batch $(b)) \
  $(if $(BENCH_RESULTS),--append_results $(BENCH_RESULTS)) $(BENCH_ARGS)

PIP_INSTALL = $(PYTHON) -m pip install $(if $(OFFLINE),--no-deps --no-build-isolation --no-index,)

.PHONY: help install apex doctor bench test test-lowest test-gpu test-gpu-slow test-perf lint style clean

help:
	@echo "make install     install hf_apex (+dev, plot and trl extras) unless installed from here; torch $(TORCH_VERSION) (CI's pin) only if torch is missing"
	@echo "make bench       the stage ladder (CUDA: BERT, GPT-2, Llama; CPU: tiny BERT, GPT-2): table, CSV/JSON, chart in $(BENCH_DIR)/"
	@echo "make test        CPU test suite (what CI runs)"
	@echo "make test-lowest CPU test suite in $(LOWEST_VENV) at the lowest versions pyproject.toml allows (CI runs it too)"
	@echo "make test-gpu    GPU tests but the long loss curves (pytest -m 'gpu and not slow and not perf'): CUDA and apex"
	@echo "make test-gpu-slow  the long GPU loss-curve tests (pytest -m 'gpu and slow'), real data from ../shared/data"
	@echo "make test-perf   timing assertions on the GPU (pytest -m perf)"
	@echo "make apex        build NVIDIA Apex from source with its C++/CUDA extensions (APEX_SRC=<checkout>; APEX_EXTENSIONS=hf_apex: only the two hf_apex loads)"
	@echo "make doctor      which apex kernels are available, with a runtime proof"
	@echo "make lint        ruff check + format check;  make style: fix both"

# Where hf_apex is installed from (asked from /, so this checkout's own folder does not answer); FORCE_INSTALL=1
# reinstalls anyway.
INSTALLED_FROM = $(shell cd / && $(PYTHON) -c "import hf_apex, os; print(os.path.dirname(os.path.dirname(os.path.realpath(hf_apex.__file__))))" 2>/dev/null)

install:
ifeq ($(INSTALLED_FROM)$(FORCE_INSTALL),$(realpath $(CURDIR)))
	@echo "hf_apex is installed from this checkout (make install FORCE_INSTALL=1 reinstalls)"
else
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP_INSTALL) "torch==$(TORCH_VERSION)"
	$(PIP_INSTALL) -e ".$(if $(OFFLINE),,[dev,plot,trl])"
endif

apex: install
	$(PYTHON) -m hf_apex.build_apex --commit $(APEX_COMMIT) --jobs $(APEX_PARALLEL_BUILD) --extensions $(APEX_EXTENSIONS) \
	  $(if $(APEX_SRC),--src $(APEX_SRC),)
	$(PYTHON) -m hf_apex doctor --strict

# On a CUDA machine whose apex lacks its kernels, build apex first.
bench: install
	@if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  $(PYTHON) -c "import sys; from hf_apex.kernels.apex.availability import is_fused_adam_available as a, is_fused_norm_available as n; sys.exit(0 if a() and n() else 1)" \
	  || $(MAKE) apex; fi
	$(PYTHON) recipes/bench.py $(strip $(BENCH_FLAGS))

doctor:
	$(PYTHON) -m hf_apex doctor

test: install
	$(PYTHON) -m pytest -m "not gpu" tests $(PYTEST_ARGS)

test-lowest:
	@test -n "$(LOWEST_PYTHON)" || { echo "make test-lowest: no Python 3.10 (requires-python's lower bound) found; set LOWEST_PYTHON"; exit 1; }
	test -x $(LOWEST_VENV)/bin/python || $(LOWEST_PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -c .ci/lowest.txt -e ".[dev,plot,trl]" wheel
	$(LOWEST_VENV)/bin/python .ci/lowest.py
	$(LOWEST_VENV)/bin/python -m pytest -m "not gpu" tests $(PYTEST_ARGS)

test-gpu: install
	$(PYTHON) -m pytest -m "gpu and not slow and not perf" tests $(PYTEST_ARGS)

test-gpu-slow: install
	$(PYTHON) -m pytest -m "gpu and slow and not perf" tests $(PYTEST_ARGS)

test-perf: install
	$(PYTHON) -m pytest -m perf tests $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

style:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .bench
