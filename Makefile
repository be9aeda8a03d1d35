# Two commands do everything on a fresh clone: `make bench` and `make test`.
# They create .venv (torch==$(TORCH_VERSION), CPU build) if missing, build the C++ extension from
# source, then benchmark or test. Rebuilds happen only when csrc/ or the build files change.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# The trainers the integrations are tested against, pinned to versions that work with TORCH_VERSION
TRAINERS := transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 tensorboard==2.21.0
# The detector corpus's real data sets ship inside scikit-learn (evaluation/detectors/data.py)
CORPUS := scikit-learn==1.9.1
DEPS := ninja setuptools wheel numpy pytest pytest-xdist==3.8.0 hypothesis matplotlib tqdm ruff \
	mypy==2.4.1 triton \
	$(TRAINERS) $(CORPUS)
ENV_STAMP := $(VENV)/.deps-$(TORCH_VERSION)
BUILD_STAMP := $(VENV)/.build-stamp
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: env build test test-fast test-eval bench demo lint clean cuda-check gpu-prebuilt \
	zoo-env zoo zoo-all test-zoo docs

env: $(ENV_STAMP)
$(ENV_STAMP): Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(DEPS)
	touch $@

build: $(BUILD_STAMP)
$(BUILD_STAMP): $(ENV_STAMP) $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# Test tiers, by folder: `make test` runs the library's tests (tests/); `make test-eval` runs the
# tests of the tooling around it: evaluation/tests/ (the detector corpus and the trainer runs,
# scored against their goals; the runs that train are marked corpus) and bench/tests/ (the
# benchmarks' harness, baselines, read floor, prebuilt extension and the dry runs of
# bench/gpu_check.sh, marked device_script); CI runs both. `make test-fast` (the edit-test loop)
# runs the library's tests but those marked slow. Each runs on one intra-op thread: on a shared
# machine two threads wait for each other's core at every op (CONTRIBUTING.md). The statistics
# do not depend on the thread count (the CPU kernel cuts its work into the same chunks and
# merges them in one fixed tree for any count), and a test that trains a model must hold on one
# thread and on several (its float sums differ).
LIBRARY_TESTS := tests
EVAL_TESTS := evaluation/tests bench/tests
# 2**31 + 100 elements (2 GB of int8, 4 GB of bfloat16) for the 64-bit indexing: on the
# default kernel variant only
BIG := --deselect tests/ops/test_kernels.py::test_more_than_2_pow_31_elements
# The compiled kernels' own tests: what a CPU kernel variant, the thread count or another
# build of the extension can change
KERNEL_TESTS := tests/ops/test_kernels.py tests/ops/test_kernel_nonfinite.py \
	tests/ops/test_range.py tests/ops/test_fuzz.py
# The benchmark's read floor, a build of the same kernels that only reads: on every variant too
READ_PROBE_TESTS := bench/tests/test_read_probe.py
ONE_THREAD := OMP_NUM_THREADS=1 FASTHEALTH_REQUIRE_CPU=1
# pytest-xdist's worker processes, one intra-op thread each: JOBS=1 runs the tests in one process
JOBS ?= 2
XDIST := $(if $(filter-out 1,$(JOBS)),-n $(JOBS))

# `each_isa NAME,PYTEST-ARGS`: those tests again on the default intra-op threads (the parallel pass and its
# merge), then on every other CPU kernel variant this processor runs (avx2, avx, base)
define each_isa
	@echo "== $(1) on the default intra-op threads"
	FASTHEALTH_REQUIRE_CPU=1 $(PY) -m pytest -q $(2)
	for isa in $$($(PY) -c "import fasthealth as f; print(' '.join(f.ops.compiled.C.cpu_isas()[1:]))"); do \
		echo "== $(1) on CPU kernel variant $$isa"; \
		$(ONE_THREAD) FASTHEALTH_CPU_ISA=$$isa $(PY) -m pytest -q $(XDIST) $(2) \
			|| exit 1; \
	done
endef

# Each test once per thing it proves: the library's tests on the fastest CPU kernel variant, one
# thread, with the slowest tests listed (test_triton.py skips itself here: TRITON_INTERPRET is
# unset); the kernel tests again on the default threads and on every other variant; then the
# Triton kernels through Triton's interpreter in their own process (TRITON_INTERPRET must be
# set before triton is imported).
test: build
	$(ONE_THREAD) $(PY) -m pytest -q $(XDIST) --durations=25 $(LIBRARY_TESTS)
	$(call each_isa,the kernel tests,$(BIG) $(KERNEL_TESTS))
	TRITON_INTERPRET=1 $(ONE_THREAD) $(PY) -m pytest -q tests/ops/test_triton.py

# The evaluation's and the benchmarks' own tests (the corpus and trainer runs, the device
# script's dry runs), then the read floor on every kernel variant as the kernel tests
test-eval: build
	$(ONE_THREAD) $(PY) -m pytest -q $(XDIST) --durations=15 $(EVAL_TESTS)
	$(call each_isa,the read floor,$(READ_PROBE_TESTS))

test-fast: build
	$(ONE_THREAD) $(PY) -m pytest -q $(XDIST) -x -m "not slow" --durations=10 $(LIBRARY_TESTS)

# The results go to build/bench-results/ (git ignores it); `make bench RECORD=1` writes them
# into bench/results/, the tracked figures the docs cite.
bench: build
	$(PY) bench/harness.py $(if $(RECORD),--record)

# A small GPT-like run with planted faults: every detector fires, a report is written (into
# build/, which git ignores).
demo: build
	$(PY) -m fasthealth demo --log-dir build/demo-run

# ruff over the code, then mypy over fasthealth/ (its settings: [tool.mypy] in pyproject.toml)
# the documentation site (MkDocs, Material, mkdocstrings) into build/site: --strict, so a broken
# link, a page left out of the nav or an API name that no longer exists fails the build
DOCS_STAMP := $(VENV)/.docs-deps
$(DOCS_STAMP): docs/requirements.txt $(ENV_STAMP)
	$(PY) -m pip install -q -r docs/requirements.txt
	touch $@
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

lint: env
	$(PY) -m ruff check fasthealth tests bench evaluation triton_kernels examples
	$(PY) -m mypy

clean:
	rm -rf build fasthealth/_C*.so *.egg-info $(BUILD_STAMP)

# The CUDA build on a machine without a GPU (CI runs it after `make test`): a separate
# environment with torch==2.14.1 (CUDA 13.0) and nvcc from CUDA_HOME compiles csrc/ for sm_80
# and sm_90 in a copy of the tree (so its _C never mixes with .venv's), imports it, checks the
# CUDA kernel is registered, and runs there the tests that build or that torch can change:
# tests/ops/test_cuda_build.py (machine code for both architectures, no register spills, the main
# loops' instruction counts), the build's own, the public API and backend choice with CUDA
# kernels compiled in, the work-list planner, and the CPU kernel tests (the same sources
# compiled alongside nvcc's objects, against another torch).
# test_bad_input.py's report tests read logs (matplotlib, nothing of the build): not here
NOT_CUDA := not test_report_
CUDA_CHECK_TESTS := tests/ops/test_cuda_build.py tests/ops/test_build.py tests/test_api.py \
	tests/ops/test_plan.py tests/test_selftest.py tests/test_bad_input.py $(KERNEL_TESTS)
CUDA_VENV ?= .venv-cuda
CUDA_PY := $(CURDIR)/$(CUDA_VENV)/bin/python
CUDA_HOME ?= /usr/local/cuda
CUDA_TORCH ?= 2.14.1
CUDA_TREE := build/cuda-check

cuda-check:
	test -x $(CUDA_PY) || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install -q torch==$(CUDA_TORCH) ninja setuptools wheel numpy pytest \
		pytest-xdist==3.8.0 hypothesis
	rm -rf $(CUDA_TREE) && mkdir -p $(CUDA_TREE)
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C $(CUDA_TREE)
	cd $(CUDA_TREE) && CUDA_HOME=$(CUDA_HOME) PATH=$(CUDA_HOME)/bin:$$PATH \
		TORCH_CUDA_ARCH_LIST="8.0;9.0" FASTHEALTH_FORCE_CUDA=1 \
		$(CUDA_PY) -m pip install -q --no-build-isolation --no-deps -e .
	cd $(CUDA_TREE) && $(CUDA_PY) -c "import torch, fasthealth as fh; \
		assert fh.ops.compiled.C is not None and fh.ops.compiled.C.with_cuda, fh.ops.compiled.load_error; \
		assert torch._C._dispatch_has_kernel_for_dispatch_key('fasthealth::multi_tensor_stats', 'CUDA'); \
		print('CUDA extension built for sm_80 and sm_90 with torch', torch.__version__)"
	cd $(CUDA_TREE) && $(ONE_THREAD) TORCH_CUDA_ARCH_LIST="8.0;9.0" \
		$(CUDA_PY) -m pytest -q $(XDIST) $(BIG) -k "$(NOT_CUDA)" $(CUDA_CHECK_TESTS)

# The extension for a GPU machine, built ahead of time on one without a GPU (docs/gpu.md):
# bench/gpu_check.sh loads it there instead of compiling it. _C loads only under the CPython and
# the torch it was compiled against, so a separate environment holds the GPU machine's: CPython
# $(PREBUILT_PYTHON) (3.12) and torch==$(DEVICE_TORCH) (CUDA 13.0, as pip's wheel); nvcc from
# CUDA_HOME compiles csrc/ for sm_90 only in a copy of the tree. The library and its manifest
# (bench/prebuilt.py: Python, torch, CUDA, architectures, the sources' hash, so gpu_check.sh
# refuses a stale one) go into $(PREBUILT_DIR); then the import test and the CPU kernel tests
# under that torch. Copy $(PREBUILT_DIR) into the GPU machine's checkout.
# python3.12 on PATH, unless given: make gpu-prebuilt PREBUILT_PYTHON=/path/to/python3.12
PREBUILT_PYTHON ?= $(or $(shell command -v python3.12),python3.12)
DEVICE_TORCH ?= 2.11.0
PREBUILT_VENV ?= .venv-gpu312
PREBUILT_PY := $(CURDIR)/$(PREBUILT_VENV)/bin/python
PREBUILT_TREE := build/prebuilt-tree
PREBUILT_DIR := build/prebuilt
PREBUILT_ARCH := 9.0

gpu-prebuilt:
	@test -x $(PREBUILT_PYTHON) || { echo "gpu-prebuilt: no Python at" \
		"PREBUILT_PYTHON=$(PREBUILT_PYTHON); set it to a CPython of the GPU machine's version" \
		"(3.12): make gpu-prebuilt PREBUILT_PYTHON=/path/to/python3.12"; exit 1; }
	test -x $(PREBUILT_PY) || $(PREBUILT_PYTHON) -m venv $(PREBUILT_VENV)
	$(PREBUILT_PY) -m pip install -q torch==$(DEVICE_TORCH) ninja setuptools wheel numpy pytest \
		hypothesis
	rm -rf $(PREBUILT_TREE) $(PREBUILT_DIR) && mkdir -p $(PREBUILT_TREE) $(PREBUILT_DIR)
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C $(PREBUILT_TREE)
	cd $(PREBUILT_TREE) && CUDA_HOME=$(CUDA_HOME) PATH=$(CUDA_HOME)/bin:$$PATH \
		TORCH_CUDA_ARCH_LIST=$(PREBUILT_ARCH) FASTHEALTH_FORCE_CUDA=1 MAX_JOBS=2 \
		$(PREBUILT_PY) setup.py -q build_ext --inplace
	cp $(PREBUILT_TREE)/fasthealth/_C.*.so $(PREBUILT_DIR)/
	$(PREBUILT_PY) bench/prebuilt.py write-manifest $(PREBUILT_DIR) --root $(PREBUILT_TREE) \
		--arch $(PREBUILT_ARCH)
	$(PREBUILT_PY) bench/prebuilt.py check $(PREBUILT_DIR) --arch $(PREBUILT_ARCH)
	cd $(PREBUILT_TREE) && ln -sfn ../triton_kernels fasthealth/triton_kernels && \
		$(PREBUILT_PY) -c "import pathlib, torch, fasthealth as fh; \
		assert pathlib.Path(fh.__file__).parent == pathlib.Path('fasthealth').resolve(), fh.__file__; \
		assert fh.ops.compiled.C is not None and fh.ops.compiled.C.with_cuda, fh.ops.compiled.load_error; \
		assert torch._C._dispatch_has_kernel_for_dispatch_key('fasthealth::multi_tensor_stats', 'CUDA'); \
		print('prebuilt', fh.ops.compiled.C.__file__, 'loads: CUDA kernels registered, torch', \
		torch.__version__, 'CPU kernel variant', fh.ops.compiled.cpu_isa())"
	cd $(PREBUILT_TREE) && OMP_NUM_THREADS=1 FASTHEALTH_REQUIRE_CPU=1 \
		$(PREBUILT_PY) -m pytest -q -x -p no:cacheprovider $(BIG) tests/ops/test_kernels.py
	@ls -l $(PREBUILT_DIR)

# The zoo (evaluation/zoo/zoo.py): torchvision's, timm's and Hugging Face's models, trained
# tiny on CPU by a hand-written loop, timm's training loop and the Hugging Face Trainer,
# healthy and with planted faults.
# torchvision and timm need a torch build that matches them (PyPI's torchvision links against
# a CUDA build, which runs on the CPU): their own environment, apart from the tests' .venv.
# fasthealth is run from this tree there, on the 'torch' backend (the .venv's _C is built for
# another torch; the zoo measures detection, not speed).
ZOO_VENV ?= .venv-zoo
ZOO_PY := $(ZOO_VENV)/bin/python
ZOO_TORCH ?= torch==2.14.1 torchvision==0.29.1
ZOO_STAMP := $(ZOO_VENV)/.deps

zoo-env: $(ZOO_STAMP)
$(ZOO_STAMP): Makefile
	test -x $(ZOO_PY) || $(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_PY) -m pip install -q $(ZOO_TORCH) timm==1.0.31 transformers==5.24.0 \
		accelerate==1.15.0 $(CORPUS) numpy pytest pytest-xdist==3.8.0
	touch $@

# the quick tier's tests (evaluation/zoo/test_quick.py: ResNet-18's replay, timm's loop healthy
# with and without its scheduler, every fault on timm's ResNet); CI runs them
test-zoo: zoo-env
	PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(ZOO_PY) -m pytest -q -p no:cacheprovider \
		$(if $(filter-out 1,$(JOBS)),-n $(JOBS)) evaluation/zoo/test_quick.py

# the quick tier (a few models and ways, every fault) into build/; `make zoo-all` the whole,
# into bench/results/zoo.json
zoo: zoo-env
	PYTHONPATH=$(CURDIR) $(ZOO_PY) -m evaluation.zoo.zoo --quick --out build/zoo-quick.json

zoo-all: zoo-env
	PYTHONPATH=$(CURDIR) $(ZOO_PY) -m evaluation.zoo.zoo --out bench/results/zoo.json
