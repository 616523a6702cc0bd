# Two commands for a fresh clone: `make train` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# Machines without an NVIDIA GPU get the CPU build of torch, pinned with its local label so pip can
# never fall back to the multi-GB CUDA wheels. Where no local wheel or mirror provides it, point pip at
# PyTorch's CPU index: make TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= torch==$(TORCH_VERSION)$(if $(HAS_NVIDIA),,+cpu)
TORCH_INDEX_URL ?=
PIP_TORCH_ARGS := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)

.PHONY: install train test test-fast lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed  ## create .venv and install the project with pinned versions

train: install  ## train with the default config; pass Hydra overrides as ARGS="strategy=ddp trainer.devices=2"
	$(BIN)/python train.py $(ARGS)

test: install  ## the whole test suite (what CI runs)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install  ## the suite without the slow end-to-end runs
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lock: install  ## rewrite constraints.txt from the current .venv
	( head -n 2 constraints.txt; $(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//' ) > constraints.tmp && mv constraints.tmp constraints.txt

clean:
	rm -rf $(VENV) logs outputs multirun
