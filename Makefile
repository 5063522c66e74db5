# Quick start targets: each creates its own virtualenv in .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test browser gpu-check install clean

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

# Two pytest workers on a 2-core machine: a single-process test keeps one core busy and a two-rank test
# about one and a half, so one worker left a core idle most of the suite. Each worker runs whole
# modules (their loaded pipelines are built once) and one thread per process.
TEST_WORKERS ?= 2

test: install browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The playground's test drives a real headless Chromium: the system's, installed from Debian / Ubuntu
# packages when missing and apt-get may be used (as root); else that one test is skipped, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "accel: installing Chromium (apt-get) for the playground's browser test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } || \
	  echo "accel: could not install Chromium; the playground's browser test will be skipped"; \
	else echo "accel: no Chromium (install it to run the playground's browser test; it is skipped)"; fi

# Needs one NVIDIA GPU: the CUDA-only tests and every benchmark's CUDA section in under 9 minutes;
# the Markdown for BENCHMARKS.md is printed and written to outputs/gpu-check.md. A GPU machine
# without network (its image's torch, accel's other dependencies on PYTHONPATH): GPU_PYTHON=python3
# runs it there without the install.
GPU_PYTHON ?=
gpu-check:
	@if [ -n "$(GPU_PYTHON)" ]; then $(GPU_PYTHON) benchmarks/gpu_check.py; else $(MAKE) install && $(BIN)/python benchmarks/gpu_check.py; fi

clean:
	rm -rf $(VENV) build *.egg-info
