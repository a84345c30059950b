# The one command a fresh machine needs: `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest venv clean

test: $(STAMP) lint typecheck pytest

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build from this machine's disk; never a CUDA build.
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -r requirements-dev.txt '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/codespell kfac testing tests examples README.md

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	rm -f .coverage .coverage.*
	$(VENV)/bin/coverage run -m pytest -q -p no:cacheprovider
	$(VENV)/bin/coverage combine -q
	$(VENV)/bin/coverage report

clean:
	rm -rf $(VENV) .coverage .coverage.* .mypy_cache .ruff_cache .pytest_cache
