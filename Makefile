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
# VENV_FLAGS=--system-site-packages: a .venv that sees the system's packages, and so its torch (kept as it is);
# also those of a PYTHON that is itself a venv (scripts/venv.sh).
VENV_FLAGS ?=
# The offline GPU bundle (make gpu-bundle writes it, make gpu-check installs it) and where gpu-check writes results.
BUNDLE ?= gpu-bundle
BUNDLE_PYTHON ?= 3.12
LOCAL_PYTHON = $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
OUT ?= gpu-check-results
# The suite in TEST_WORKERS pytest-xdist processes: its runs wait on start-up, W&B and signals for about a third of
# their time, which a second process fills. Each file's tests stay in one process (loadfile), so that a module's
# fixture runs once; the session's shared runs are made once for all (tests/conftest.py: shared_run).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
# make test-box-torch: the tests marked torch_internals on BOX_TORCH_VERSION, the GPU boxes' torch, in BOX_TORCH_VENV,
# installed as make install installs .venv. PyPI's Linux wheel of that torch is the CUDA build (with CUDA's libraries,
# about 3.5 GB on disk), which runs on a CPU as the CPU build does.
BOX_TORCH_VERSION ?= 2.11.0
BOX_TORCH_VENV ?= .venv-torch$(BOX_TORCH_VERSION)
# make test-busy: the suite beside this many busy loops per core (no test may depend on wall time).
BUSY_PER_CORE ?= 3

.PHONY: help install train demo test test-fast test-busy test-box-torch lint lock clean gpu-bundle gpu-check gpu-collect
.PHONY: offline-check

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 16

$(BIN)/python:
	bash scripts/venv.sh $(PYTHON) $(VENV) $(VENV_FLAGS)

# A torch the venv already has is kept: it is pinned to itself for the project's install, so pip fails rather than
# replace it (constraints.txt pins no torch). Its installed version, not torch.__version__: PyPI's CUDA wheels are
# 2.11.0 to pip but say 2.11.0+cu130 at run time.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	@echo "make install: torch ($(TORCH_SPEC), unless $(VENV) has one): a minute or two"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
	  > $(VENV)/torch-installed.txt
	@echo "make install: the project and its pinned dependencies (constraints.txt): a few minutes on a first install"
	$(BIN)/pip install -q -c constraints.txt -c $(VENV)/torch-installed.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed  ## create .venv and install the project with pinned versions

train: install  ## train with the default config; pass Hydra overrides as ARGS="strategy=ddp trainer.devices=2"
	$(BIN)/python train.py $(ARGS)

demo: install  ## a first look in a few minutes on 2 CPU cores: a memory plan, a DDP/FSDP sweep, its report
	bash scripts/demo.sh $(BIN)/python

test: install  ## the whole test suite (what CI runs); lists its 25 slowest tests, to keep it within 20 minutes
	$(BIN)/python -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

test-fast: install  ## the suite without the slow end-to-end runs
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-busy: install  ## the whole suite beside BUSY_PER_CORE busy loops per core; prints the load it ran under
	bash scripts/busy.sh $(BUSY_PER_CORE) $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-box-torch:  ## the tests that lean on torch's internals, on the GPU boxes' torch (2.11), in a venv of its own
	$(MAKE) install VENV=$(BOX_TORCH_VENV) TORCH_SPEC=torch==$(BOX_TORCH_VERSION)
	$(BOX_TORCH_VENV)/bin/python -m pytest -m torch_internals $(XDIST) $(PYTEST_ARGS)

lint: install  ## ruff (lint, import order, format) on the repo, mypy on project/ (CI runs it before the tests)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

lock: install  ## rewrite constraints.txt from the current .venv (torch and its CUDA packages left out)
	( head -n 3 constraints.txt; $(BIN)/pip freeze --exclude-editable --exclude torch \
	  | grep -Ev '^(nvidia-|triton==|cuda-)' ) > constraints.tmp && mv constraints.tmp constraints.txt

gpu-bundle: install  ## write BUNDLE (gpu-bundle/): the wheels an offline GPU box lacks beside its torch
	$(BIN)/python scripts/gpu_bundle.py --python-version $(BUNDLE_PYTHON) $(BUNDLE)

gpu-check:  ## on an offline GPU box: BUNDLE over its torch, then pytest -m gpu and benchmarks/gpu.py into OUT
	bash scripts/gpu_check.sh $(BUNDLE) $(OUT)

gpu-collect:  ## on an offline GPU box, in one 9-minute call: what --refit reads, into OUT/collect/gpu_collect.json
	GPU_CHECK_PARTS=collect bash scripts/gpu_check.sh $(BUNDLE) $(OUT)

offline-check: install  ## make gpu-bundle and gpu-check on a simulated GPU box: a CPU torch, no GPU (CI runs it)
	$(MAKE) gpu-bundle
	$(MAKE) gpu-bundle BUNDLE=$(BUNDLE)-local BUNDLE_PYTHON=$(LOCAL_PYTHON)
	PYTHON=$(PYTHON) PIP_TORCH_ARGS="$(PIP_TORCH_ARGS)" bash scripts/offline_check.sh $(BUNDLE)-local $(BUNDLE)

clean:  ## remove .venv, the run outputs, the GPU bundle and its venv
	rm -rf $(VENV) $(BOX_TORCH_VENV) logs outputs multirun $(BUNDLE) $(BUNDLE)-local .gpu-venv
