#!/usr/bin/env bash
# Every GPU step in one call on the lent H200 (device tool), within ~8 minutes:
#   build the extension there with its own torch and nvcc, run the `gpu` tests and the Triton
#   and CPU suites' GPU-relevant parts, run the GPU benchmark, leave everything under $OUT.
# Usage (from the repo root): bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/fasthealth-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 FASTHEALTH_FORCE_CUDA=1
# (tests and benchmark name their backends explicitly: the automatic choice on CUDA stays the
# reference until fasthealth/backends.py's GPU_KERNELS_VALIDATED is set after a green run)
{
  nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
} > "$OUT/env.txt" 2>&1
echo "== build" | tee "$OUT/log.txt"
python3 -m pip install --no-build-isolation --no-deps -e . >> "$OUT/log.txt" 2>&1 \
  || { echo "build failed"; tail -50 "$OUT/log.txt"; exit 1; }
python3 -c "import fasthealth as fh; print('backends', fh.available_backends())" | tee -a "$OUT/log.txt"
echo "== gpu tests" | tee -a "$OUT/log.txt"
timeout 240 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
echo "== benchmark" | tee -a "$OUT/log.txt"
timeout 300 python3 bench/bench_gpu.py --out "$OUT" --reps 15 2>&1 | tee "$OUT/bench.txt" | tail -40
echo "done; results in $OUT"
