# Two commands do everything on a fresh clone: `make bench` and `make test`.
# They create .venv (torch==$(TORCH_VERSION), CPU build) if missing, build the C++ extension from
# source, then benchmark or test. Rebuilds happen only when csrc/ or the build files change.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# The trainers the integrations are tested against, pinned to versions that work with TORCH_VERSION
TRAINERS := transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 tensorboard==2.21.0
# The detector corpus's real data sets ship inside scikit-learn (bench/detectors/data.py)
CORPUS := scikit-learn==1.9.1
DEPS := ninja setuptools wheel numpy pytest hypothesis matplotlib tqdm ruff mypy==2.4.1 triton \
	$(TRAINERS) $(CORPUS)
ENV_STAMP := $(VENV)/.deps-$(TORCH_VERSION)
BUILD_STAMP := $(VENV)/.build-stamp
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: env build test test-fast bench demo lint clean cuda-check

env: $(ENV_STAMP)
$(ENV_STAMP): Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(DEPS)
	touch $@

build: $(BUILD_STAMP)
$(BUILD_STAMP): $(ENV_STAMP) $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# Test tiers (markers in pyproject.toml): `make test` runs every test, `make test-fast` (the
# edit-test loop) all but those marked slow, corpus (the detector corpus) or device_script (the
# dry runs of bench/gpu_check.sh), on one intra-op thread: on a shared machine two threads wait
# for each other's core at every op (CONTRIBUTING.md has the figures); the statistics do not
# depend on the thread count, and `make test` runs the default threads.
FAST := not slow and not corpus and not device_script
# 2**31 + 100 elements (2 GB of int8, 4 GB of bfloat16) for the 64-bit indexing: on the
# default kernel variant only
BIG := --deselect tests/test_kernels.py::test_more_than_2_pow_31_elements

# The suite (test_triton.py skips itself here: TRITON_INTERPRET is unset) on the fastest CPU
# kernel variant, with the slowest tests listed, the kernel tests again on every other variant
# this processor runs (avx2, avx, base), then the Triton kernels through Triton's interpreter in
# their own process (TRITON_INTERPRET must be set before triton is imported).
test: build
	FASTHEALTH_REQUIRE_CPU=1 $(PY) -m pytest -q --durations=25 tests
	for isa in $$($(PY) -c "import fasthealth as f; print(' '.join(f.ops.compiled.C.cpu_isas()[1:]))"); do \
		echo "== CPU kernel variant $$isa"; \
		FASTHEALTH_REQUIRE_CPU=1 FASTHEALTH_CPU_ISA=$$isa $(PY) -m pytest -q $(BIG) \
			tests/test_kernels.py tests/test_fuzz.py tests/test_range.py tests/test_kernel_nonfinite.py || exit 1; \
	done
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_triton.py

test-fast: build
	OMP_NUM_THREADS=1 FASTHEALTH_REQUIRE_CPU=1 $(PY) -m pytest -q -x -m "$(FAST)" --durations=10 tests

# The results go to build/bench-results/ (git ignores it); `make bench RECORD=1` writes them
# into bench/results/, the tracked figures the docs cite.
bench: build
	$(PY) bench/harness.py $(if $(RECORD),--record)

# A small GPT-like run with planted faults: every detector fires, a report is written (into
# build/, which git ignores).
demo: build
	$(PY) -m fasthealth demo --log-dir build/demo-run

# ruff over the code, then mypy over fasthealth/ (its settings: [tool.mypy] in pyproject.toml)
lint: env
	$(PY) -m ruff check fasthealth tests bench triton_kernels examples
	$(PY) -m mypy

clean:
	rm -rf build fasthealth/_C*.so *.egg-info $(BUILD_STAMP)

# The CUDA build on a machine without a GPU (CI runs it after `make test`): a separate
# environment with torch==2.14.1 (CUDA 13.0) and nvcc from CUDA_HOME compiles csrc/ for sm_80
# and sm_90 in a copy of the tree (so its _C never mixes with .venv's), imports it, checks the
# CUDA kernel is registered, and runs the CPU suite there too (with tests/test_cuda_build.py:
# machine code for both architectures, no register spills).
CUDA_VENV ?= .venv-cuda
CUDA_PY := $(CURDIR)/$(CUDA_VENV)/bin/python
CUDA_HOME ?= /usr/local/cuda
CUDA_TORCH ?= 2.14.1
CUDA_TREE := build/cuda-check

cuda-check:
	test -x $(CUDA_PY) || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install -q torch==$(CUDA_TORCH) ninja setuptools wheel numpy pytest \
		hypothesis matplotlib $(CORPUS)
	rm -rf $(CUDA_TREE) && mkdir -p $(CUDA_TREE)
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C $(CUDA_TREE)
	cd $(CUDA_TREE) && CUDA_HOME=$(CUDA_HOME) PATH=$(CUDA_HOME)/bin:$$PATH \
		TORCH_CUDA_ARCH_LIST="8.0;9.0" FASTHEALTH_FORCE_CUDA=1 \
		$(CUDA_PY) -m pip install -q --no-build-isolation --no-deps -e .
	cd $(CUDA_TREE) && $(CUDA_PY) -c "import torch, fasthealth as fh; \
		assert fh.ops.compiled.C is not None and fh.ops.compiled.C.with_cuda, fh.ops.compiled.load_error; \
		assert torch._C._dispatch_has_kernel_for_dispatch_key('fasthealth::multi_tensor_stats', 'CUDA'); \
		print('CUDA extension built for sm_80 and sm_90 with torch', torch.__version__)"
	cd $(CUDA_TREE) && FASTHEALTH_REQUIRE_CPU=1 TORCH_CUDA_ARCH_LIST="8.0;9.0" \
		$(CUDA_PY) -m pytest -q -m "not corpus and not device_script" $(BIG) tests
