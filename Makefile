# Two commands do everything on a fresh clone: `make bench` and `make test`.
# They create .venv (torch==$(TORCH_VERSION), CPU build) if missing, build the C++ extension from
# source, then benchmark or test. Rebuilds happen only when csrc/ or the build files change.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEPS := ninja setuptools wheel numpy pytest hypothesis matplotlib tqdm ruff triton
ENV_STAMP := $(VENV)/.deps-$(TORCH_VERSION)
BUILD_STAMP := $(VENV)/.build-stamp
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: env build test test-fast bench lint clean

env: $(ENV_STAMP)
$(ENV_STAMP): Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(DEPS)
	touch $@

build: $(BUILD_STAMP)
$(BUILD_STAMP): $(ENV_STAMP) $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The suite (test_triton.py skips itself here: TRITON_INTERPRET is unset), the kernel tests
# again on the portable (non-AVX) CPU kernel, then the Triton kernels through Triton's
# interpreter in their own process (TRITON_INTERPRET must be set before triton is imported).
test: build
	FASTHEALTH_REQUIRE_CPU=1 $(PY) -m pytest -q tests
	FASTHEALTH_REQUIRE_CPU=1 FASTHEALTH_CPU_ISA=base $(PY) -m pytest -q -m "not slow" \
		tests/test_kernels.py tests/test_fuzz.py
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_triton.py

test-fast: build
	FASTHEALTH_REQUIRE_CPU=1 $(PY) -m pytest -q -x -m "not slow" tests

bench: build
	$(PY) -m fasthealth bench --out bench/results

lint: env
	$(PY) -m ruff check fasthealth tests bench triton_kernels

clean:
	rm -rf build fasthealth/_C*.so *.egg-info $(BUILD_STAMP)
