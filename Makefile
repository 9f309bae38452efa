# Two entry points: `make demo` and `make test`. Each sets up .venv first when needed:
# torch (pinned, alone first: an unpinned resolve would fetch a CUDA build), then both
# distributions of this repository, editable, with their test extras.
# TORCH=2.14.1 or TORCH=2.15.0 (any release devipc supports) does the same in a venv of its own,
# .venv-torch<version>: `make test TORCH=2.15.0`. openreg's C++ glue is built against that torch.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH ?= 2.13.0
VENV := $(if $(filter 2.13.0,$(TORCH)),.venv,.venv-torch$(TORCH))
# Every pip command of the set-up holds torch at $(TORCH): a constraints file of the venv's own,
# in place of any machine-wide one (which may cap torch below the release asked for).
PIN := $(VENV)/torch-pin.txt
# openreg is editable in .venv; another torch's venv installs its own build (built under the venv,
# so the two never overwrite each other's _C).
DEFAULT_VENV := $(filter .venv,$(VENV))
OPENREG := $(if $(DEFAULT_VENV),-e )'./openreg[test,onnx]'
OPENREG_ENV := $(if $(DEFAULT_VENV),,OPENREG_BUILD_BASE=$(abspath $(VENV))/openreg-build)
# vLLM (tests/test_vllm.py, examples/vllm_weight_sync.py) through devipc's `vllm` extra: its CPU
# build pins torch 2.13.0+cpu, so only .venv gets it (the vLLM tests skip elsewhere). The index's
# torchvision, torchaudio and torchcodec that it pulls link CUDA libraries and break vLLM's
# import: removed.
VLLM_SETUP = PIP_CONSTRAINT=$(PIN) $(PIP) install -q --no-build-isolation -e '.[vllm]' \
  && $(PIP) uninstall -q -y torchvision torchaudio torchcodec
SOURCES := pyproject.toml openreg/pyproject.toml openreg/setup.py $(wildcard openreg/csrc/*/* openreg/csrc/*/*/*)
SOURCES += $(if $(DEFAULT_VENV),,$(wildcard openreg/src/*.py openreg/src/*/*.py))  # not editable there
# `make test PYTEST_ARGS='-m "not slow"'`: what CI runs on the newest torch.
PYTEST_ARGS ?=
# The suite runs in TEST_JOBS pytest-xdist workers (`auto`: one per core, at most 4); most of a
# test's time is spawned children importing torch, which two workers overlap on two cores.
# TEST_JOBS=0 runs it in this process alone.
TEST_JOBS ?= auto
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.devipc-installed

.PHONY: demo test lint format sanitize check-install bench bench-all fuzz stress conformance setup

demo: $(STAMP)
	$(PY) examples/ipc_demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --maxprocesses 4 --dist loadgroup $(PYTEST_ARGS)

# openreg's C++: the runtime, the glue and the runtime's native test.
CXX_SOURCES := $(wildcard openreg/csrc/*/*.cpp openreg/csrc/*/*.h openreg/csrc/*/*/*.cpp tests/openreg/native/*.cpp)
RUNTIME_SOURCES := $(wildcard openreg/csrc/runtime/*.cpp)
NATIVE_TEST := tests/openreg/native/runtime_test.cpp

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)
	$(VENV)/bin/clang-tidy --quiet $(RUNTIME_SOURCES) $(NATIVE_TEST) -- -std=c++17 -Iopenreg/csrc/runtime -pthread
	$(PY) -m ruff format --check .  # last: `make format` fixes what it finds

format: $(STAMP)
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)
	$(PY) -m ruff format .

# The runtime's native test, built with the runtime's sources under AddressSanitizer with
# UndefinedBehaviorSanitizer, then under ThreadSanitizer; a report fails the run (~1 min).
SANITIZE_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -Wall -Wextra -Werror -pthread -Iopenreg/csrc/runtime
sanitize:
	mkdir -p build/sanitize
	c++ $(SANITIZE_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all $(RUNTIME_SOURCES) $(NATIVE_TEST) -o build/sanitize/address
	ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1 build/sanitize/address
	c++ $(SANITIZE_FLAGS) -fsanitize=thread $(RUNTIME_SOURCES) $(NATIVE_TEST) -o build/sanitize/thread
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 build/sanitize/thread

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
	$(PY) benchmarks/fleet_relay.py  # as root: network namespaces
	$(PY) benchmarks/vllm_weight_update.py  # .venv: vLLM

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
	echo "torch==$(TORCH)" > $(PIN)
	PIP_CONSTRAINT=$(PIN) $(PIP) install -q torch==$(TORCH)
	PIP_CONSTRAINT=$(PIN) $(PIP) install -q setuptools wheel ninja
	PIP_CONSTRAINT=$(PIN) $(PIP) install -q --no-build-isolation -e '.[test,lint,nixl,ray]'
	@echo "building devipc-openreg: C++ runtime and PyTorch glue (full log: $(VENV)/openreg-build.log)"
	$(if $(DEFAULT_VENV),,$(PIP) uninstall -q -y devipc-openreg)  # a rebuild, not "already satisfied"
	$(OPENREG_ENV) PIP_CONSTRAINT=$(PIN) $(PIP) install --no-build-isolation $(OPENREG) -v 2>&1 | tee $(VENV)/openreg-build.log \
	  | sed -un 's/^ *\(\[[0-9]*\/[0-9]*\]\) .* -c \([^ ]*\) .*/  \1 \2/p; /runtime: /p' \
	  || { tail -40 $(VENV)/openreg-build.log; exit 1; }
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -c "import devipc_openreg"
	$(if $(DEFAULT_VENV),$(VLLM_SETUP))
	touch $(STAMP)
