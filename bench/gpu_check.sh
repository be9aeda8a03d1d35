#!/usr/bin/env bash
# Every GPU step in one run on a machine with an NVIDIA GPU, and a results file whatever happens:
# $OUT/<card>.json (bench/gpu_results.py; the card's name from nvidia-smi, h200.json on an H200;
# OUT is build/gpu-check unless set) is rewritten after
# every benchmark case and every step, so a step that fails, hangs or is skipped, or the whole
# run cut short, still leaves every case that ran and every step's status. Its "machine" entry
# names the GPU and the versions it ran with.
#
# Usage, from the repo root: bash bench/gpu_check.sh [--quick]
# (to skip the build there: `make gpu-prebuilt` on a build machine, then copy build/prebuilt/
#  into the GPU machine's checkout)
#
# Steps, most wanted first, with their limits in seconds (at most / needed to start) and the
# time each should take on an H200 (estimates; a slower GPU needs a larger DEADLINE):
#   env           20 /  5   ~5 s   the GPU, driver, torch, triton, nvcc         -> env.txt
#   prebuilt      30 /  5   ~10 s  the extension built ahead of time (`make gpu-prebuilt`,
#                                  build/prebuilt): its manifest checked against this tree,
#                                  Python and torch (bench/prebuilt.py), the library copied
#                                  into fasthealth/, then imported: CUDA kernels registered.
#                                  When it loads, no build step runs; when it is refused or
#                                  does not load, the copy is removed and the build runs
#                                                                               -> build.txt
#   build-cuda   170 / 60   ~90 s  the extension (sm_90, 16 jobs)               -> build.txt
#   build-cpu     90 / 30   ~30 s  only if the CUDA build failed: the CPU extension, so that
#                                  the Triton steps still run
#   backends      20 /  5   ~5 s   which GPU backends load
#   bench-cuda   120 / 30   ~50 s  bench/bench_gpu.py: cuda and every baseline  -> bench.txt
#   bench-triton  80 / 20   ~40 s  the same for triton, in its own process (an illegal address
#                                  in one backend cannot poison the other)
#   selftest      90 / 30   ~45 s  fasthealth selftest; its record goes into <card>.json
#                                                                               -> selftest.txt
#   tests        130 / 30   ~90 s  tests/ops/test_gpu.py, one pytest process per backend, side by
#                                  side; a per-test limit fails that test only; one stuck past
#                                  it ends its process and the tests after it run again
#                                                                               -> tests.txt
#   rollback      90 / 30   ~40 s  bench/bench_rollback.py --device cuda: what in-process
#                                  rollback's snapshots cost training (GPT-2 small built on the
#                                  GPU, about 170 training steps: 20 at a time, with and
#                                  without a snapshot; needs transformers); its record goes
#                                  into <card>.json too
#                                                                 -> rollback.txt, rollback.json
#   finish        30 / 10   ~5 s   the goals and <card>.png
# The last recorded run took 381 s with the prebuilt (bench/results/h200.json's steps), before
# the rollback step was added. A step gets at most its own limit, and never more than the
# deadline leaves after the needs of every step still to come: one that overruns cannot starve
# the ones after it, and finish always has its time. At its limit a step gets SIGINT (pytest
# still prints its summary, the benchmark stops between writes), then SIGKILL 10 s later.
# Written under $OUT (10 files): summary.txt env.txt build.txt bench.txt selftest.txt tests.txt
# rollback.txt rollback.json (when that step ends well) <card>.json <card>.png; <card>.json is copied
# into bench/results/ too.
#
# Knobs, for the dry run here (bench/tests/test_gpu_check.py) and for reruns:
#   DEADLINE=S              the whole run's time budget in seconds (480)
#   FASTHEALTH_GPU_DRY=1    no GPU needed: no build, both backends assumed, the benchmark with
#                           fake timings (bench_gpu.py --fake), a fake selftest record and
#                           a fake rollback record (bench_rollback.py --fake); the tests run
#                           for real (tests/ops/test_gpu.py skips itself without CUDA)
#   FORCE_FAIL=a,b          these steps fail at once; FORCE_HANG=a,b: they hang to their limit
#   FASTHEALTH_GPU_LIMITS=name=S,...   a step's own limit
#   FASTHEALTH_GPU_TEST_FILES="..."    the test files (tests/ops/test_gpu.py)
#   FASTHEALTH_GPU_CARD=NAME           the results file's stem (bench/gpu_results.py card)
#   FASTHEALTH_GPU_COPY=PATH           the copy of <card>.json (bench/results/<card>.json; none in
#                                      a dry run), empty for none
#   PYTHON                             the interpreter (python3)
#   FASTHEALTH_PREBUILT=DIR            the prebuilt library and its manifest (build/prebuilt)
#   FASTHEALTH_PREBUILT_PKG=DIR        where it is copied (fasthealth; the dry-run tests point
#                                      it out of the tree)
#   FASTHEALTH_GPU_DRY_PREBUILT=loads|fails|real   in a dry run, the prebuilt's import test:
#                                      faked to pass (the default) or to fail, or run for real
#                                      (a real library, FASTHEALTH_PREBUILT_PKG=fasthealth); the
#                                      manifest's check, the copy and the clean-up run for real,
#                                      and a dry run removes what it copied when it ends
set -uo pipefail
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-480}
DRY=${FASTHEALTH_GPU_DRY:-}
QUICK=
[ "${1:-}" = --quick ] && QUICK=--quick
CARD=${FASTHEALTH_GPU_CARD:-$($PY bench/gpu_results.py card)}
RESULTS=$OUT/$CARD.json
COPY=${FASTHEALTH_GPU_COPY-bench/results/$CARD.json}
[ -n "$DRY" ] && COPY=${FASTHEALTH_GPU_COPY:-}  # a dry run writes into the tree only if told
TEST_FILES=${FASTHEALTH_GPU_TEST_FILES:-tests/ops/test_gpu.py}
TEST_LIMIT=${FASTHEALTH_TEST_TIMEOUT:-40}  # per test; stuck in C code: 15 s more, then exit
SUMMARY=$OUT/summary.txt
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
PREBUILT=${FASTHEALTH_PREBUILT:-build/prebuilt}
PKG=${FASTHEALTH_PREBUILT_PKG:-fasthealth}
DRY_PREBUILT=${FASTHEALTH_GPU_DRY_PREBUILT:-loads}
export PY WORK TEST_FILES TEST_LIMIT PREBUILT PKG DRY DRY_PREBUILT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the in-place build, when pip cannot install
start=$(date +%s)
: > "$SUMMARY"
: > "$WORK/steps.tsv"
results=(--results "$RESULTS")
[ -n "$COPY" ] && results+=(--copy "$COPY")

declare -A MAXT MINT DONE
ORDER=()
plan() { ORDER+=("$1"); MAXT[$1]=$2; MINT[$1]=$3; }
plan env 20 5
plan prebuilt 30 5
plan build-cuda 170 60
plan build-cpu 90 30
plan backends 20 5
plan bench-cuda 120 30
plan bench-triton 80 20
plan selftest 90 30
plan tests 130 30
plan rollback 90 30
plan finish 30 10
DONE[build-cpu]=1  # nothing kept for it unless the CUDA build fails

elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
listed() { [[ ",$2," == *",$1,"* ]]; }  # listed NAME LIST: NAME is in the comma list

# reserve NAME: what the steps after NAME still to run need
reserve() {
  local s sum=0 after=
  for s in "${ORDER[@]}"; do
    [ -n "$after" ] && [ -z "${DONE[$s]:-}" ] && sum=$(( sum + MINT[$s] ))
    [ "$s" = "$1" ] && after=1
  done
  echo "$sum"
}

# record NAME STATUS SECONDS LIMIT RC [NOTE]: summary.txt, and the steps into <card>.json (the
# note too); STATUS "not run": a step that was not needed (it does not fail the run)
record() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6:-}" >> "$WORK/steps.tsv"
  if [ "$2" = "not run" ]; then
    echo "$1: not run${6:+ $6}" >> "$SUMMARY"
  else
    echo "$1: $2 in $3 s (limit $4 s, exit $5)${6:+ $6}" >> "$SUMMARY"
  fi
  "$PY" bench/gpu_results.py "${results[@]}" steps "$WORK/steps.tsv" --deadline "$DEADLINE" \
    --elapsed "$(elapsed)" ${DRY:+--dry} >> "$SUMMARY" 2>&1
}

# step NAME LOG COMMAND...: COMMAND (its output appended to LOG) under the step's limit, cut to
# what the deadline leaves after the later steps' needs; skipped when that is under its own
# need. STEP_END (epoch seconds) tells the command when it will be stopped; what it writes into
# $WORK/why-NAME (one line) is recorded as the step's note. Returns its status.
step() {
  local name=$1 log=$2; shift 2
  local limit=${MAXT[$name]} need=${MINT[$name]} own
  own=$(tr ',' '\n' <<< "${FASTHEALTH_GPU_LIMITS:-}" | sed -n "s/^$name=//p")
  if [ -n "$own" ]; then limit=$own; (( need > own )) && need=$own; fi
  DONE[$name]=1
  local avail=$(( $(left) - $(reserve "$name") ))
  (( avail < limit )) && limit=$avail
  if (( limit < need )); then
    record "$name" SKIPPED 0 "$limit" 124 "(needs ${need} s; the deadline leaves ${avail} s)"
    return 124
  fi
  if listed "$name" "${FORCE_FAIL:-}"; then
    set -- bash -c "echo 'forced failure (FORCE_FAIL)'; exit 3"
  elif listed "$name" "${FORCE_HANG:-}"; then
    set -- bash -c "echo 'forced hang (FORCE_HANG)'; exec sleep 100000"
  fi
  echo "== $name (limit ${limit} s, t=$(elapsed) s): $*" >> "$log"
  local t0 rc status=ok
  t0=$(date +%s)
  STEP_END=$(( t0 + limit )) timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  (( rc == 124 || rc == 137 )) && status="TIMED OUT"
  (( rc != 0 && rc != 124 && rc != 137 )) && status=FAILED
  local note=
  [ -s "$WORK/why-$name" ] && note="($(tr -s '\t\n' ' ' < "$WORK/why-$name" | cut -c1-400 \
    | sed 's/ *$//'))"
  record "$name" "$status" $(( $(date +%s) - t0 )) "$limit" "$rc" "$note"
  return $rc
}

# use_prebuilt: the library of $PREBUILT into $PKG, when its manifest matches this tree, Python
# and torch; then the import test the backends step needs: _C loads from there, with its CUDA
# kernels registered. Every file it puts there is listed in $WORK/prebuilt-copied (a library
# already there is moved aside first), so that unuse_prebuilt can take them out again even
# after a timeout's SIGKILL; why it failed, in $WORK/why-prebuilt.
use_prebuilt() {
  local lib name why=$WORK/why-prebuilt
  lib=$(ls "$PREBUILT"/_C.*.so | head -1)
  name=${lib##*/}
  echo "prebuilt: $lib"
  if ! "$PY" bench/prebuilt.py check "$PREBUILT" > "$WORK/prebuilt-check.txt" 2>&1; then
    cat "$WORK/prebuilt-check.txt"
    sed -n 's/^prebuilt refused: //p' "$WORK/prebuilt-check.txt" \
      | awk 'NR > 1 {printf "; "} {printf "%s", $0}' > "$why"
    [ -s "$why" ] || tail -1 "$WORK/prebuilt-check.txt" > "$why"  # it did not get that far
    return 1
  fi
  cat "$WORK/prebuilt-check.txt"
  mkdir -p "$PKG"
  if [ -e "$PKG/$name" ]; then
    mv "$PKG/$name" "$WORK/previous-lib" && echo "$PKG/$name" > "$WORK/prebuilt-moved"
  fi
  echo "$PKG/$name" >> "$WORK/prebuilt-copied"
  cp "$lib" "$PKG/$name" || { echo "could not copy $lib into $PKG/" > "$why"; return 1; }
  if ! [ -e "$PKG/triton_kernels" ] && ! [ -L "$PKG/triton_kernels" ]; then  # as install() does
    echo "$PKG/triton_kernels" >> "$WORK/prebuilt-copied"
    ln -s "$(realpath -s --relative-to="$PKG" triton_kernels)" "$PKG/triton_kernels"
  fi
  local test=("$PY" -c "
import pathlib, torch, fasthealth as fh
C, here = fh.ops.compiled.C, pathlib.Path('$PKG').resolve()
assert pathlib.Path(fh.__file__).parent.resolve() == here, f'fasthealth is {fh.__file__}'
assert C is not None, f'_C does not load: {fh.ops.compiled.load_error}'
assert pathlib.Path(C.__file__).resolve() == here / '$name', f'_C is {C.__file__}'
assert C.with_cuda, '_C has no CUDA kernels'
assert torch._C._dispatch_has_kernel_for_dispatch_key('fasthealth::multi_tensor_stats',
    'CUDA'), 'no CUDA kernel registered for fasthealth::multi_tensor_stats'
print('the prebuilt loads:', C.__file__, 'torch', torch.__version__)")
  if [ -n "$DRY" ] && [ "$DRY_PREBUILT" != real ]; then
    test=(bash -c "[ -f '$PKG/$name' ] && [ -f '$PKG/triton_kernels/__init__.py' ] || exit 1
      [ '$DRY_PREBUILT' = fails ] && { echo 'AssertionError: dry run: faked load failure'; exit 1; }
      echo 'dry run: the prebuilt loads (faked: FASTHEALTH_GPU_DRY_PREBUILT=$DRY_PREBUILT)'")
  fi
  "${test[@]}" > "$WORK/prebuilt-load.txt" 2>&1
  local rc=$?
  cat "$WORK/prebuilt-load.txt"
  if (( rc != 0 )); then
    echo "does not load: $(grep -v '^ \|^Traceback' "$WORK/prebuilt-load.txt" | tail -1)" \
      > "$why"
    return 1
  fi
}

# unuse_prebuilt: take out what use_prebuilt put in $PKG, and put back what it moved aside
unuse_prebuilt() {
  local f
  if [ -f "$WORK/prebuilt-copied" ]; then
    while read -r f; do rm -f "$f"; done < "$WORK/prebuilt-copied"
    rm -f "$WORK/prebuilt-copied"
  fi
  if [ -f "$WORK/prebuilt-moved" ]; then
    mv "$WORK/previous-lib" "$(cat "$WORK/prebuilt-moved")" && rm -f "$WORK/prebuilt-moved"
  fi
  return 0
}
export -f use_prebuilt

finish_up() {
  if ! [ -s "$RESULTS" ]; then  # gpu_results.py never ran: the steps, written from here
    {
      printf '{"rows": [], "error": "bench/gpu_results.py did not write this file (see'
      printf ' summary.txt)", "steps": ['
      awk -F'\t' '{printf "%s{\"name\": \"%s\", \"status\": \"%s\", \"seconds\": %d,",
                          (NR > 1 ? ", " : ""), $1, $2, $3
                   printf " \"limit\": %d, \"rc\": %d", $4, $5
                   note = $6; gsub(/["\\]/, "'"'"'", note)
                   printf "%s}", (note != "" ? ", \"note\": \"" note "\"" : "")}' \
        "$WORK/steps.tsv"
      printf ']}\n'
    } > "$RESULTS"
    [ -n "$COPY" ] && mkdir -p "$(dirname "$COPY")" && cp "$RESULTS" "$COPY"
  fi
  {
    echo
    echo "== total $(elapsed) s of ${DEADLINE} s"
    for f in env build bench selftest tests rollback; do
      [ -f "$OUT/$f.txt" ] || continue
      echo; echo "== tail of $f.txt"; tail -25 "$OUT/$f.txt"
    done
  } >> "$SUMMARY"
  cat "$SUMMARY"
  [ -n "$DRY" ] && unuse_prebuilt  # a dry run leaves nothing in the tree
  rm -rf "$WORK"
}
trap finish_up EXIT
trap 'exit 130' INT TERM

step env "$OUT/env.txt" bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    || echo "no nvidia-smi"
  nvcc --version | tail -2 || echo "no nvcc"
  "$PY" -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\",
    torch.version.cuda, \"triton\", triton.__version__, \"device\",
    torch.cuda.is_available() and torch.cuda.get_device_name())"'

# the prebuilt first: when it loads, nothing is built here
prebuilt=
if ! ls "$PREBUILT"/_C.*.so > /dev/null 2>&1; then
  DONE[prebuilt]=1
  record prebuilt "not run" 0 0 0 "(no prebuilt library in $PREBUILT: building here)"
elif step prebuilt "$OUT/build.txt" bash -c use_prebuilt; then
  prebuilt=1
  "$PY" bench/gpu_results.py "${results[@]}" attach prebuilt "$PREBUILT/manifest.json" \
    >> "$SUMMARY" 2>&1
else
  unuse_prebuilt
  echo "the prebuilt was not used: building here" >> "$SUMMARY"
fi

install() {  # the editable install; an in-place build when pip cannot install here
  "$PY" -m pip install --no-build-isolation --no-deps -e . && return 0
  echo "pip install failed: building in place instead"
  "$PY" setup.py build_ext --inplace || return 1
  [ -e fasthealth/triton_kernels ] || ln -s ../triton_kernels fasthealth/triton_kernels
}
export -f install
build=(bash -c install)
[ -n "$DRY" ] && build=(echo "dry run: no build")
if [ -n "$prebuilt" ]; then
  DONE[build-cuda]=1
  record build-cuda "not run" 0 0 0 "(the prebuilt loaded)"
elif ! step build-cuda "$OUT/build.txt" env FASTHEALTH_FORCE_CUDA=1 "${build[@]}"; then
  unset 'DONE[build-cpu]'
  echo "the CUDA build failed: building the CPU extension alone for the Triton steps" \
    >> "$SUMMARY"
  step build-cpu "$OUT/build.txt" env FASTHEALTH_SKIP_CUDA=1 "${build[@]}"
fi

if [ -n "$DRY" ]; then
  probe=(bash -c "echo '${FASTHEALTH_GPU_DRY_BACKENDS:-cuda triton}' > '$WORK/backends'")
else
  probe=("$PY" -c "
import fasthealth as fh
print('backends', fh.available_backends(), 'load_error', fh.ops.compiled.load_error)
open('$WORK/backends', 'w').write(' '.join(
    b for b in ('cuda', 'triton') if b in fh.available_backends()))")
fi
step backends "$OUT/build.txt" "${probe[@]}"
BACKENDS=$(cat "$WORK/backends" 2>/dev/null)
echo "GPU backends: ${BACKENDS:-none}" >> "$SUMMARY"

# the benchmark: the first backend's process times the baselines too (the next one does if
# that one did not finish); without a GPU backend the baselines run alone
[[ " $BACKENDS " == *" cuda "* ]] || DONE[bench-cuda]=1
[[ " $BACKENDS " == *" triton "* ]] || DONE[bench-triton]=1
fake=
[ -n "$DRY" ] && fake=--fake
baselines=
for b in ${BACKENDS:-none}; do
  name=bench-$b
  [ "$b" = none ] && name=bench-cuda
  if [ -z "$baselines" ]; then MAXT[$name]=120; MINT[$name]=30; fi
  step "$name" "$OUT/bench.txt" "$PY" bench/bench_gpu.py --backends "${b/none/}" $baselines \
    "${results[@]}" $fake $QUICK && baselines=--no-baselines
done

if [ -n "$BACKENDS" ]; then
  if [ -n "$DRY" ]; then
    selftest=(bash -c "echo 'dry run: fasthealth selftest'
      echo '{\"key\": \"dry run\", \"results\": {}}' > '$WORK/selftest.json'")
  else
    selftest=("$PY" -m fasthealth selftest --json "$WORK/selftest.json")
  fi
  step selftest "$OUT/selftest.txt" "${selftest[@]}"
  "$PY" bench/gpu_results.py "${results[@]}" attach selftest "$WORK/selftest.json" \
    >> "$SUMMARY" 2>&1
else
  DONE[selftest]=1
fi

# tests_one BACKEND KEXPR: the GPU tests of one backend (-k KEXPR), in its own process, which
# is also the automatic choice there (the monitor's and NCCL's tests: never the other backend);
# a test stuck past its limit ends that process, and the tests after it run in a new one while
# STEP_END leaves time; a few intra-op threads each, as the processes run at once and their
# float64 references on the host slow to a crawl when each takes every core
tests_one() {
  local b=$1 k=$2
  local log=$WORK/tests-$b.txt ledger=$WORK/ledger-$b hang=$WORK/hang-$b.txt
  local attempt rc worst=0 seen hung
  for attempt in 1 2 3; do
    echo "== tests, backend $b, process $attempt" >> "$log"
    seen=$( { wc -l < "$ledger"; } 2>/dev/null || echo 0)
    env FASTHEALTH_GPU_BACKENDS="$b" FASTHEALTH_BACKEND="${b/none/}" \
      OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" FASTHEALTH_TEST_TIMEOUT="$TEST_LIMIT" \
      FASTHEALTH_TEST_LEDGER="$ledger" FASTHEALTH_HANG_LOG="$hang" \
      PYTHONPATH="$PWD/tests:$PYTHONPATH" "$PY" -m pytest -p per_test_limit -v --tb=short -rs \
      -p no:cacheprovider ${k:+-k "$k"} $TEST_FILES >> "$log" 2>&1
    rc=$?
    (( worst == 0 )) && worst=$rc
    # the test this process started and never ended
    hung=$(tail -n +$(( seen + 1 )) "$ledger" 2>/dev/null | awk '
      /^start /{s[substr($0, 7)] = 1} /^end /{delete s[substr($0, 5)]} END{for (t in s) print t}')
    [ -z "$hung" ] && return $worst
    { echo; echo "== $hung did not end (exit $rc); every thread's traceback:"; cat "$hang"; } \
      >> "$log"
    : > "$hang"
    if (( $(date +%s) + 15 > STEP_END )); then
      echo "== no time left for the tests after it" >> "$log"
      return $worst
    fi
  done
  return $worst
}

# run_tests BACKEND KEXPR ...: every backend's process at once
run_tests() {
  local pids=() rc=0 p
  while (( $# )); do
    tests_one "$1" "$2" &
    pids+=($!)
    shift 2
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
export -f tests_one run_tests

# with both backends, the tests that name neither (the monitor, NCCL) run in the cuda process
# and Triton's own only in the triton one
if [[ " $BACKENDS " == *" cuda "* && " $BACKENDS " == *" triton "* ]]; then
  which=(cuda "not triton" triton triton)
elif [ -z "$BACKENDS" ]; then
  which=(none "")
else
  which=("${BACKENDS// /}" "")
fi
step tests "$OUT/tests.txt" bash -c 'run_tests "$@"' run_tests "${which[@]}"
for ((i = 0; i < ${#which[@]}; i += 2)); do
  [ -f "$WORK/tests-${which[i]}.txt" ] && cat "$WORK/tests-${which[i]}.txt" >> "$OUT/tests.txt"
done
grep -h "^== .* did not end" "$WORK"/tests-*.txt >> "$SUMMARY" 2>/dev/null

# what rollback's snapshots cost training on the GPU: the steps with a snapshot against the same
# steps without (their copies to pinned host memory overlap the steps that follow); no earlier
# run's record is left for the attach to find when this one writes none
rm -f "$OUT/rollback.json"
step rollback "$OUT/rollback.txt" "$PY" bench/bench_rollback.py --device cuda --repeats 3 \
  --out "$OUT/rollback.json" $fake
"$PY" bench/gpu_results.py "${results[@]}" attach rollback "$OUT/rollback.json" \
  >> "$SUMMARY" 2>&1

step finish "$OUT/bench.txt" "$PY" bench/gpu_results.py "${results[@]}" finish \
  --plot "$OUT/$CARD.png"

# exit status 0 when every step that ran was ok, those not needed aside (the files come back
# either way)
awk -F'\t' '$2 != "ok" && $2 != "not run" {bad = 1} END {exit bad}' "$WORK/steps.tsv"
