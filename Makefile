# Two entry points: `make demo` and `make test`. Each sets up .venv first when needed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.devipc-installed
SOURCES := setup.py pyproject.toml $(wildcard src/devipc/openreg/csrc/*/*)

.PHONY: demo test bench setup

demo: $(STAMP)
	$(PY) examples/ipc_demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/ipc_latency.py

setup: $(STAMP)

# torch is pinned and installed first, alone: an unpinned resolve would fetch a CUDA build.
$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q ninja setuptools wheel pytest numpy
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)
