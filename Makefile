# The one command a fresh machine needs: `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Which build of torch pip installs is pip's choice, from its configured
# indexes: on this project's machines the CPU build lies on local disk
# (pip.conf's find-links); on a stock machine PyPI serves the CUDA build
# (several GB). For the CPU build there, name PyTorch's CPU index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Empty (the default) adds nothing to the pip command.
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)')
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest venv clean docs dist

test: $(STAMP) lint typecheck docs pytest

$(STAMP): pyproject.toml requirements-dev.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, from TORCH_INDEX if given (see above); the next line's
	# pin then keeps it (torch==2.13.0 matches 2.13.0+cpu).
	$(PY) -m pip install --quiet $(TORCH_INDEX_ARG) '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -r requirements-dev.txt '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/codespell kfac testing tests examples README.md
	# the import layering (pyproject.toml), then no cycle and no
	# function-level import of kfac
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_imports.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml), built strictly: a broken reference,
# link or docstring fails the build. Output in site/ (ignored by git).
docs: $(STAMP)
	$(VENV)/bin/codespell docs CONTRIBUTING.md mkdocs.yml .github
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

pytest: $(STAMP)
	rm -f .coverage .coverage.*
	$(VENV)/bin/coverage run -m pytest -q -p no:cacheprovider
	$(VENV)/bin/coverage combine -q
	$(VENV)/bin/coverage report

# `make dist`: the release's wheel and sdist in dist/ (python -m build, in
# an isolated environment with setuptools from pip's indexes), checked by
# twine. tests/system/test_wheel.py checks the wheel's files in make test.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build
	$(VENV)/bin/twine check --strict dist/*

# `make original-suite ORIGINAL=/path/to/kfac-pytorch`: the original KAISA
# code's own tests (a checkout or export of gpauloski/kfac-pytorch at tag
# v0.4.2; only its tests/ and testing/ are used) run against this kfac, as a
# compatibility check. They are copied to ORIGINAL_RUN, outside the
# repository (the original's code and tests never enter it), beside a link
# to this kfac/, so that its own kfac/ cannot be imported; GPT-NeoX and the
# integration tests are left out. The failures that remain are deliberate
# changes, each with its reason in docs/guide/migrating.md ("From the
# original KAISA code"), so the target exits 1. Not part of `make test`.
ORIGINAL ?=
ORIGINAL_RUN ?= /tmp/kfac-original-suite
.PHONY: original-suite
original-suite: $(STAMP)
	$(if $(ORIGINAL),,$(error ORIGINAL=<a checkout of gpauloski/kfac-pytorch v0.4.2> is needed))
	test -d '$(ORIGINAL)/tests' && test -d '$(ORIGINAL)/testing'
	rm -rf '$(ORIGINAL_RUN)' && mkdir -p '$(ORIGINAL_RUN)'
	cp -R '$(ORIGINAL)/tests' '$(ORIGINAL)/testing' '$(ORIGINAL_RUN)/'
	ln -s '$(CURDIR)/kfac' '$(ORIGINAL_RUN)/kfac'
	cd '$(ORIGINAL_RUN)' && '$(CURDIR)/$(PY)' -m pytest -q -p no:cacheprovider \
	  -c /dev/null --rootdir . -o addopts= --timeout 300 -rfE \
	  --continue-on-collection-errors tests \
	  --ignore tests/gpt_neox --ignore tests/integration $(PYTEST_ARGS)

# `make test-torch TORCH_SPEC='torch==2.6.0'`: the pytest suite alone (no
# lint, types, docs or coverage) on another torch release, in a venv of its
# own, .venv-torch-2.6.0 (ignored by git; `make clean-torch` removes them
# all), with that torch from pip's indexes (PyPI's build: CUDA, several GB;
# TORCH_INDEX as above) and requirements-dev.txt beside it (pip refuses a
# pin that does not resolve). Tests of a feature the release lacks are
# skipped naming the release they need (testing/torch_release.py).
# PYTEST_ARGS adds pytest options. Not part of `make test` or CI; README.md
# ("Supported PyTorch releases") says which releases ran and how.
TORCH_RELEASE = $(patsubst torch==%,%,$(filter torch==%,$(TORCH_SPEC)))
TORCH_VENV = .venv-torch-$(TORCH_RELEASE)
TORCH_PY = $(TORCH_VENV)/bin/python

.PHONY: test-torch clean-torch
test-torch: $(TORCH_VENV)/.installed
	$(TORCH_PY) -c 'import torch; print("torch", torch.__version__)'
	$(TORCH_PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

$(TORCH_VENV)/.installed: pyproject.toml requirements-dev.txt requirements-nodeps.txt
	$(if $(TORCH_RELEASE),,$(error TORCH_SPEC='$(TORCH_SPEC)': name one release, e.g. TORCH_SPEC='torch==2.6.0'))
	rm -rf $(TORCH_VENV)
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_PY) -m pip install --quiet --upgrade pip
	$(TORCH_PY) -m pip install --quiet $(TORCH_INDEX_ARG) '$(TORCH_SPEC)'
	$(TORCH_PY) -m pip install --quiet -r requirements-dev.txt '$(TORCH_SPEC)'
	$(TORCH_PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(TORCH_PY) -m pip install --quiet --no-deps -e .
	touch $@

clean-torch:
	rm -rf .venv-torch-*

# `make demo`: SGD, Adam and SGD + K-FAC (tuned, and with the defaults) on
# Fashion-MNIST (examples/README.md).
# `make demo-lm`: a character GPT on the King James Bible (examples/corpus/,
# committed), AdamW against AdamW + K-FAC.
# `make integration`: the slow real-data tests that K-FAC beats SGD (Fashion-
# MNIST) and reaches AdamW's final validation loss in fewer steps (the GPT).
.PHONY: demo demo-lm integration fashion-mnist
FASHION_MNIST := /usr/share/datasets/fashion-mnist
EXAMPLES_STAMP := $(VENV)/.examples-installed

$(EXAMPLES_STAMP): $(STAMP) examples/requirements.txt
	$(PY) -m pip install --quiet -r examples/requirements.txt '$(TORCH_SPEC)'
	touch $(EXAMPLES_STAMP)

# Debian's dataset-fashion-mnist when apt-get can install it (as root);
# otherwise the demo says so and falls back to scikit-learn's 8x8 digits.
fashion-mnist:
	@test -f $(FASHION_MNIST)/train-images-idx3-ubyte.gz || \
	  { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; } || \
	  echo 'could not install dataset-fashion-mnist (needs root and apt-get)'

demo: $(EXAMPLES_STAMP) fashion-mnist
	$(PY) -m examples.fashion_mnist

demo-lm: $(EXAMPLES_STAMP)
	$(PY) -m examples.char_lm

integration: $(EXAMPLES_STAMP) fashion-mnist
	$(VENV)/bin/pytest -m integration tests/integration -p no:cacheprovider

clean:
	rm -rf $(VENV) .coverage .coverage.* .mypy_cache .ruff_cache .pytest_cache

# `make bench`: K-FAC's cost against SGD and against its arithmetic floor,
# scaling to 1024 ranks, and the byte model against gloo runs
# (benchmarks/README.md). Writes build/bench.json; prints Markdown.
.PHONY: bench
bench: $(STAMP)
	$(PY) -m benchmarks --out build/bench.json

# `make bench-fsdp`: K-FAC under FSDP2 at 2 and 4 gloo ranks: bytes per step
# and rank beside FSDP2's own (measured and checked against their formulas),
# then memory per rank, memory_usage() and a measured peak, against DDP
# (docs/guide/distributed.md). A few minutes; prints Markdown.
.PHONY: bench-fsdp
bench-fsdp: $(STAMP)
	$(PY) -m benchmarks.fsdp_bytes
	$(PY) -m benchmarks.fsdp_memory

# `make gpu-study`: the time-to-target study's task (b) on this machine's
# GPU (issue 24): Muon at lr 0.005 (the best baseline on the CPU) alone and
# with K-FAC's defaults, then AdamW at lr 0.0015 alone and with them, one
# seed, each pair in one process; at most 8 minutes (the AdamW pair runs
# even if the Muon pair times out). Uses $(PYTHON) and its own torch (with
# torch.optim.Muon) and numpy like gpu-check; prints the tables (read the
# wall seconds: CPU seconds mean little beside a GPU) and writes
# build/gpu-study/ afresh.
GPU_STUDY := $(PYTHON) -m benchmarks.study --task gpt --device cuda --seeds 0 --kfac defaults --baselines --no-plot
.PHONY: gpu-study
gpu-study:
	rm -rf build/gpu-study && mkdir -p build/gpu-study
	-PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} timeout 230 $(GPU_STUDY) --optimizers muon --lrs 0.005 --out build/gpu-study/muon.json
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} timeout 230 $(GPU_STUDY) --optimizers adamw --lrs 0.0015 --out build/gpu-study/adamw.json

# `make gpu-check`: the CUDA and NCCL paths (oracles in float64 and float32,
# autocast with a GradScaler, robustness, host syncs, the DDP oracle with
# NCCL, the benchmarks) on this machine's GPUs, in at most ~8 minutes. Uses
# $(PYTHON) and its own torch and pytest: no venv, nothing installed. Says
# why and succeeds without a GPU. scripts/gpu_check.py --help for options.
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)
