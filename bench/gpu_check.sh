#!/usr/bin/env bash
# Every GPU step in one call on the lent H200 (device tool), fail-soft, within 7 minutes worst
# case (DEADLINE seconds), each step under its own limit and the deadline:
#   env      the GPU, driver, torch, triton and nvcc there;
#   build    the extension with its own torch and nvcc (sm_90, 16 jobs); if the CUDA build fails,
#            the CPU extension alone, so that the Triton steps still run;
#   tests    tests/test_gpu.py, one process per backend (an illegal address in one backend
#            cannot poison the other's), a per-test limit that names a hang, SIGINT at the step
#            limit so pytest still prints its summary; then `fasthealth selftest`;
#   bench    bench/bench_gpu.py, one process per backend (the baselines with the first), rows
#            written after every case; then torch.compile's provider, last and only if time is
#            left; then the rows merged into h200.json, h200_machine.json, h200.png;
#   summary  every step's status, time and the tail of its output, in summary.txt.
# What comes back under $OUT (8 files at most): summary.txt, env.txt, build.txt, tests.txt,
# bench.txt, h200.json, h200_machine.json, h200.png.
# Usage (from the repo root): bash bench/gpu_check.sh [--quick]
set -uo pipefail
OUT=${OUT:-/tmp/fasthealth-gpu}
mkdir -p "$OUT"
QUICK=${1:-}
DEADLINE=${DEADLINE:-420}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 FASTHEALTH_TEST_TIMEOUT=45
export FASTHEALTH_HANG_LOG=$(mktemp)  # where a test that hangs leaves every thread's traceback
start=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
ROWS=$(mktemp -d)

left() { echo $(( DEADLINE - ($(date +%s) - start) )); }

# step NAME LIMIT LOG COMMAND...: runs COMMAND (stdout+stderr appended to LOG) under
# min(LIMIT, time left - 20 s), interrupted with SIGINT (then killed 10 s later); skipped when
# fewer than 15 s are left. Records status and time in summary.txt; returns the exit status.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local budget=$(( $(left) - 20 ))
  (( budget < limit )) && limit=$budget
  if (( limit < 15 )); then
    echo "$name: SKIPPED (no time left)" | tee -a "$SUMMARY"
    return 124
  fi
  echo "== $name (limit ${limit}s, t=$(( $(date +%s) - start ))s)" | tee -a "$log"
  local t0=$(date +%s)
  timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  local what=ok
  (( rc == 124 || rc == 137 )) && what="TIMED OUT"
  (( rc != 0 && rc != 124 && rc != 137 )) && what="FAILED (exit $rc)"
  echo "$name: $what in $(( $(date +%s) - t0 ))s" | tee -a "$SUMMARY"
  return $rc
}

step env 30 "$OUT/env.txt" bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__)"
  nvcc --version | tail -2'

install() {  # the editable install; an in-place build when pip cannot install here
  python3 -m pip install --no-build-isolation --no-deps -e . && return 0
  echo "pip install failed: building in place instead"
  python3 setup.py build_ext --inplace || return 1
  [ -e fasthealth/triton_kernels ] || ln -s ../triton_kernels fasthealth/triton_kernels
}
export -f install
if ! step build-cuda 200 "$OUT/build.txt" env FASTHEALTH_FORCE_CUDA=1 bash -c install; then
  echo "the CUDA build failed: building the CPU extension alone for the Triton steps" \
    | tee -a "$SUMMARY"
  step build-cpu-only 120 "$OUT/build.txt" env FASTHEALTH_SKIP_CUDA=1 bash -c install
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step backends 30 "$OUT/build.txt" python3 -c "
import fasthealth as fh
print('backends', fh.available_backends(), 'load_error', fh.ops.compiled.load_error)"
BACKENDS=$(python3 -c "import fasthealth as fh; print(' '.join(
  b for b in ('cuda', 'triton') if b in fh.available_backends()))" 2>/dev/null)
echo "GPU backends here: ${BACKENDS:-none}" | tee -a "$SUMMARY"

for b in $BACKENDS; do
  step "tests-$b" 100 "$OUT/tests.txt" env FASTHEALTH_GPU_BACKENDS="$b" \
    python3 -m pytest -v -rs -p no:cacheprovider tests/test_gpu.py
  if [ -s "$FASTHEALTH_HANG_LOG" ]; then
    echo "tests-$b: a test hung (45 s): its tracebacks are in tests.txt" | tee -a "$SUMMARY"
    { echo "== tracebacks of the hung test"; cat "$FASTHEALTH_HANG_LOG"; } >> "$OUT/tests.txt"
    : > "$FASTHEALTH_HANG_LOG"
  fi
done

# the user's own validation (docs/spec.md section 9): its table goes to tests.txt
[ -n "$BACKENDS" ] && step selftest 120 "$OUT/tests.txt" python3 -m fasthealth selftest

baselines=""
for b in $BACKENDS; do
  step "bench-$b" 90 "$OUT/bench.txt" python3 bench/bench_gpu.py --backends "$b" \
    --no-compile $baselines --reps 15 --rows "$ROWS/rows-$b.json" $QUICK
  baselines="--no-baselines"
done
if [ -z "$QUICK" ] && [ -n "$BACKENDS" ]; then
  step bench-compile 75 "$OUT/bench.txt" python3 bench/bench_gpu.py --compile-only --reps 15 \
    --rows "$ROWS/rows-compile.json"
fi
step merge 30 "$OUT/bench.txt" python3 bench/bench_gpu.py --out "$OUT" --merge "$ROWS"/rows-*.json

{
  echo
  echo "== total $(( $(date +%s) - start ))s of ${DEADLINE}s"
  for f in env build tests bench; do
    [ -f "$OUT/$f.txt" ] || continue
    echo; echo "== tail of $f.txt"; tail -30 "$OUT/$f.txt"
  done
} >> "$SUMMARY"
cat "$SUMMARY"
rm -rf "$ROWS"
