# make demo: train a sharded model, checkpoint it, restore onto other meshes.
# make test: the whole test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test lint bench
demo: $(VENV)/.installed
	$(PY) examples/demo.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/compare.py $(ARGS)
