# make demo: train a sharded model, checkpoint it, restore onto other meshes.
# make test: the whole test suite (what CI runs).
# make test-floors: the suite again on the oldest supported versions (.ci/floors.txt).
# make soak: the model-based test of run directories, searching far longer than CI does.
# make typecheck: mypy, strict, over jaxckpt/ (what CI runs after the tests).
# make wheel-test: build the sdist and the wheel, install the wheel into a clean environment
#   and smoke-test it from outside the source tree (CI runs it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The floor environment: Python 3.11 and the exact versions in .ci/floors.txt.
FLOORS_PYTHON ?= python3.11
FLOORS_VENV ?= .venv-floors

$(FLOORS_VENV)/.installed: pyproject.toml .ci/floors.txt
	$(FLOORS_PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install -q -c .ci/floors.txt -e '.[test]'
	touch $@

.PHONY: demo test test-floors lint typecheck bench soak wheel-test
demo: $(VENV)/.installed
	$(PY) examples/demo.py $(ARGS)

# The suite in JOBS processes (pytest-xdist), each test file whole in one of them (its module
# fixtures, e.g. a multi-host group, run once): most tests wait on subprocesses, servers or
# deadlines, so two share 2 cores well. JOBS=0 runs it in this one process.
JOBS ?= 2
PYTEST_JOBS := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_JOBS)

test-floors: $(FLOORS_VENV)/.installed
	$(FLOORS_VENV)/bin/python -m pytest $(PYTEST_JOBS)

lint: $(VENV)/.installed
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

typecheck: $(VENV)/.installed
	$(PY) -m mypy

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/compare.py $(ARGS)

SOAK_EXAMPLES ?= 500
SOAK_STEPS ?= 25
soak: $(VENV)/.installed
	JAXCKPT_MODEL_EXAMPLES=$(SOAK_EXAMPLES) JAXCKPT_MODEL_STEPS=$(SOAK_STEPS) \
		$(PY) -m pytest tests/test_model.py -p no:cacheprovider -o addopts= -q -s

WHEEL_VENV ?= .venv-wheel
wheel-test: $(VENV)/.installed
	rm -rf dist $(WHEEL_VENV)
	$(PY) -m pip install -q build
	$(PY) -m build -q --outdir dist .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install -q dist/jaxckpt-*.whl
	cd "$$(mktemp -d)" && $(CURDIR)/$(WHEEL_VENV)/bin/python $(CURDIR)/tests/wheel_smoke.py $(CURDIR)
