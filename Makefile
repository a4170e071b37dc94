# The README's commands. Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is reused when the system Python already imports it (a user's CUDA build stays);
# otherwise this build is installed (a local CPU build on the project's CI machines).
TORCH_SPEC ?= torch==2.13.0
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: demo test test-reverse lint test-pythons lab bench gpu-check ui-deps clean

$(BIN)/python:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "reusing the system's torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else $(PYTHON) -m venv $(VENV); fi

$(VENV)/.torch: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	@touch $@

$(VENV)/.core: $(VENV)/.torch pyproject.toml
	$(PIP) install -e '.[hf]' nbclient nbformat ipykernel
	@touch $@

$(VENV)/.test: $(VENV)/.core pyproject.toml
	$(PIP) install -e '.[test,hf,ui]'
	@touch $@

demo: $(VENV)/.core
	$(BIN)/python scripts/run_notebook.py notebooks/quickstart.ipynb

# Independent tests run on $(TEST_WORKERS) xdist workers; real kernels and the browser are each one
# xdist_group (one worker, one after another), so they never start side by side.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The same suite in reverse order (pytest-reverse): no test may depend on what ran before it.
test-reverse: $(VENV)/.test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --reverse

# ruff and mypy over the package (config in pyproject.toml); make test runs it first.
lint: $(VENV)/.test
	$(BIN)/python -m ruff check oom_magic
	$(BIN)/python -m mypy

# Every Python that pyproject's requires-python admits, without torch (venvs in .venvs/pyXY, made once):
# import every module, ruff's undefined-name check for that version, and the torch-free tests.
PYTHONS ?= 3.10 3.11 3.12 3.13
TORCH_FREE_TESTS := tests/reliability/test_reliability_ii_torchfree.py tests/heap/test_walk_records.py tests/device/test_nvml.py tests/device/test_processes.py tests/heap/test_walk_chains.py
test-pythons:
	scripts/test_pythons.sh "$(PYTHONS)" "$(TORCH_FREE_TESTS)"

lab: $(VENV)/.test
	$(BIN)/jupyter lab notebooks/

bench: $(VENV)/.test
	$(PIP) install -e '.[bench]'
	# ipyexperiments depends on the deprecated `pynvml` distribution, which shadows nvidia-ml-py's
	# module and makes torch.cuda warn; nvidia-ml-py already provides what it imports.
	$(PIP) install --no-deps ipyexperiments
	$(BIN)/python benchmarks/run.py

# On a machine with one NVIDIA GPU: the CUDA suite, summary table and JSON in $(OOM_MAGIC_GPU_OUT).
# Installs nothing (GPU machines may be offline): the script names any missing package; no GPU: skipped, exit 0.
gpu-check: $(BIN)/python
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf $(VENV) .venvs notebooks/*.executed.ipynb .pytest_cache
