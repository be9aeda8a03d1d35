#!/usr/bin/env bash
# Every GPU step in one call on the lent H200 (device tool), within ~8 minutes:
#   1. build the extension there with its own torch and nvcc (sm_90 only, 16 jobs), editable
#      install; if pip cannot install, an in-place build with the package laid out by hand;
#   2. the `gpu` tests (tests/test_gpu.py: both kernels against the reference, every kernel
#      path, the SPEC section 5 guarantees, the NCCL path);
#   3. the GPU benchmark (bench/bench_gpu.py).
# Everything lands under $OUT (at most 8 files come back): env.txt, build.txt, gpu_tests.txt,
# bench.txt, h200.json, h200_machine.json, h200.png.
# Usage (from the repo root): bash bench/gpu_check.sh [--quick]
set -uo pipefail
OUT=${OUT:-/tmp/fasthealth-gpu}
mkdir -p "$OUT"
QUICK=${1:-}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 FASTHEALTH_FORCE_CUDA=1
# (tests and benchmark name their backends explicitly: the automatic choice on CUDA stays the
# reference until fasthealth/ops/backends.py's GPU_KERNELS_VALIDATED is set after a green run)
start=$(date +%s)
stamp() { echo "== $1 (t=$(( $(date +%s) - start ))s)"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stamp build
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.txt" 2>&1; then
  echo "pip install failed (tail below); building in place instead"
  tail -5 "$OUT/build.txt"
  python3 setup.py build_ext --inplace >> "$OUT/build.txt" 2>&1 \
    || { echo "build failed"; tail -40 "$OUT/build.txt"; exit 1; }
  [ -e fasthealth/triton_kernels ] || ln -s ../triton_kernels fasthealth/triton_kernels
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "
import fasthealth as fh, torch
print('backends', fh.available_backends(), 'load_error', fh.ops.compiled.load_error)
assert 'cuda' in fh.available_backends() and 'triton' in fh.available_backends()
" 2>&1 | tee -a "$OUT/build.txt"

stamp "gpu tests"
timeout 170 python3 -m pytest -q -rs tests/test_gpu.py > "$OUT/gpu_tests.txt" 2>&1
echo "pytest exit $?"
tail -25 "$OUT/gpu_tests.txt"

stamp benchmark
timeout 250 python3 bench/bench_gpu.py --out "$OUT" --reps 15 $QUICK > "$OUT/bench.txt" 2>&1
echo "bench exit $?"
cat "$OUT/bench.txt"
stamp done
