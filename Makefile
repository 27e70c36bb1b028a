# hqtflow: `make demo` sets up and runs the main job on the embedded SmolLM2; `make test` runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup prepare demo test test-fast bench clean

$(BIN)/hqtflow: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU PyTorch first (a local wheel here); an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# TGI's client pins huggingface-hub<1 (transformers>=5 needs >=1): without its dependencies (see pyproject.toml)
	$(BIN)/python -m pip install -q --no-deps 'text-generation>=0.7'
	touch $(BIN)/hqtflow

setup: $(BIN)/hqtflow

prepare: setup
	$(BIN)/hqtflow model prepare smollm2

# The main job on SmolLM2: measure (offline lm-eval tasks + WikiText-2) -> FP8 checkpoint -> eval vs bf16.
demo: prepare
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/hqtflow run recipes/smollm2.yaml

test: prepare
	$(BIN)/python -m pytest --durations=25

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" --durations=15

# The CPU benches that need no FP8 checkpoint, at their small defaults (each prints ratios against a baseline of the same run).
bench: prepare
	$(BIN)/python bench/measure_overhead.py
	$(BIN)/python bench/bf16_matmul.py
	$(BIN)/python bench/gptq.py
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python bench/eval_throughput.py

clean:
	rm -rf $(VENV) out hqt_output .pytest_cache
