# Quick start targets: each creates its own virtualenv in .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test gpu-check install clean

# The first install downloads torch, diffusers and transformers (a few GB): say so, and let pip show
# what it fetches rather than sit silent for minutes.
$(BIN)/accel: pyproject.toml
	@echo "accel: installing into $(VENV) with torch, diffusers and transformers; a few GB, several minutes the first time"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install --progress-bar on -e '.[test]'
	touch $(BIN)/accel
	@echo "accel: installed ($(BIN)/accel)"

install: $(BIN)/accel

demo: install
	$(BIN)/accel run tiny-flux --steps 12 --cache 0.4 --compare --repeats 9

test: install
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q

# Needs one NVIDIA GPU: the CUDA-only tests and every benchmark's CUDA section in under 9 minutes;
# the Markdown for BENCHMARKS.md is printed and written to outputs/gpu-check.md. A GPU machine
# without network (its image's torch, accel's other dependencies on PYTHONPATH): GPU_PYTHON=python3
# runs it there without the install.
GPU_PYTHON ?=
gpu-check:
	@if [ -n "$(GPU_PYTHON)" ]; then $(GPU_PYTHON) benchmarks/gpu_check.py; else $(MAKE) install && $(BIN)/python benchmarks/gpu_check.py; fi

clean:
	rm -rf $(VENV) build *.egg-info
