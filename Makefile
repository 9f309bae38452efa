# Two entry points: `make demo` and `make test`. Each sets up .venv first when needed:
# torch (pinned, alone first: an unpinned resolve would fetch a CUDA build), then both
# distributions of this repository, editable, with their test extras.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.devipc-installed
SOURCES := pyproject.toml openreg/pyproject.toml openreg/setup.py $(wildcard openreg/csrc/*/* openreg/csrc/*/*/*)

.PHONY: demo test lint check-install bench bench-all fuzz stress conformance setup

demo: $(STAMP)
	$(PY) examples/ipc_demo.py

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# Wheels of both packages, installed into a fresh venv (no editable paths), then used there.
check-install: $(STAMP)
	$(PY) tests/packaging/check_install.py

bench: $(STAMP)
	$(PY) benchmarks/ipc_latency.py

# Every benchmark behind docs/benchmarks.md, one after the other (several minutes).
bench-all: bench
	$(PY) benchmarks/weight_sync.py
	$(PY) benchmarks/weight_publisher.py
	$(PY) benchmarks/device_ops.py
	$(PY) benchmarks/p2p_bandwidth.py

# The long runs behind docs/reliability.md (the suite runs bounded versions of both).
fuzz: $(STAMP)
	$(PY) benchmarks/fuzz_handles.py --mutations 5000 --seed 7
	$(PY) benchmarks/fuzz_wire.py --mutations 7000 --seed 7

stress: $(STAMP)
	OPENREG_IPC_EVENTS=0 $(PY) benchmarks/stress.py
	OPENREG_IPC_EVENTS=1 $(PY) benchmarks/stress.py
	$(PY) benchmarks/p2p_stress.py --threads 8 --transfers 10000
	$(PY) benchmarks/exit_soak.py --runs 100 --limit 5
	OPENREG_EXIT_RUNS=100 $(PY) -m pytest -q tests/openreg/test_exit.py

# The conformance kit (python -m devipc.conformance) against openreg, in both IPC modes.
conformance: $(STAMP)
	OPENREG_IPC_EVENTS=0 $(PY) -m devipc.conformance --device openreg
	OPENREG_IPC_EVENTS=1 $(PY) -m devipc.conformance --device openreg

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q setuptools wheel ninja
	$(PIP) install -q --no-build-isolation -e '.[test,lint,nixl]'
	@echo "building devipc-openreg: C++ runtime and PyTorch glue (full log: $(VENV)/openreg-build.log)"
	$(PIP) install --no-build-isolation -e './openreg[test]' -v 2>&1 | tee $(VENV)/openreg-build.log \
	  | sed -un 's/^ *\(\[[0-9]*\/[0-9]*\]\) .* -c \([^ ]*\) .*/  \1 \2/p; /runtime: /p' \
	  || { tail -40 $(VENV)/openreg-build.log; exit 1; }
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -c "import devipc_openreg"
	touch $(STAMP)
