# Two entry points: `make demo` and `make test`. Each creates or updates the virtualenv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUNS ?= runs

.PHONY: setup demo test test-slow bench lint clean

setup: $(VENV)/.installed

# The CPU build of torch is installed first where no torch is present, so that the range in
# pyproject.toml (torch>=2.6) never pulls the multi-GB CUDA build on a CPU machine.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The reverse-text demo: tiny model, SFT, RL, with held-out evals; its last line is JSON.
demo: setup
	$(PY) examples/reverse_text/demo.py --runs $(RUNS)

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check fnt steps scripts tests

clean:
	rm -rf $(RUNS) .pytest_cache
