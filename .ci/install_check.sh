#!/usr/bin/env bash
# The install commands a user types, each from a fresh venv and a copy of the tracked sources
# (what a clone has), in a temporary directory:
#   (a) plain `pip install .` without torch: fails, with the message that says what to run, and
#       leaves nothing installed;
#   (c) plain `pip install .` with torch installed: fails the same way (pip's isolated build
#       hides the installed torch, and torch is not a build requirement);
#   (b) `pip install --no-build-isolation .` with torch installed: builds against that torch;
#       from outside the source tree the compiled cpu backend loads and check_grads works;
#   (d) the sdist carries every file under csrc/ (headers too), so it builds elsewhere.
# Prints a PASS or FAIL line per check; exits non-zero if any failed. 2.5 minutes on 2 cores
# (torch ~45 s, compiling the CPU kernels 80-100 s). Environment: PYTHON (python3), TORCH_VERSION
# (2.13.0), KEEP=1 keeps the temporary directory.
set -uo pipefail
unset PYTHONPATH PIP_NO_BUILD_ISOLATION
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fasthealth-install-check.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then echo "install check: keeping $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
SRC=$WORK/src
PY=$WORK/venv/bin/python
FAILED=0
START=$SECONDS

pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; FAILED=1; }
tail_of() { echo "---- last lines of $1:"; grep -v "is ignored: it is neither" "$1" | tail -n 40; echo "----"; }

# What setup.py prints when it cannot see the user's torch: each line must reach the user.
MESSAGE_LINES=(
  "fasthealth: cannot build:"
  "pip install torch "
  "pip install --no-build-isolation ."
)

# A plain `pip install .` (from SRC, as a user types it) must fail with the message and install
# nothing. $1: the check's name, $2: its log.
expect_refused() {
  local name=$1 log=$2 missing=0 line
  if (cd "$SRC" && "$PY" -m pip install .) >"$log" 2>&1; then
    fail "$name: pip install . succeeded"; tail_of "$log"; return
  fi
  for line in "${MESSAGE_LINES[@]}"; do
    grep -qF -- "$line" "$log" || { fail "$name: pip's output lacks '$line'"; missing=1; }
  done
  [ $missing = 0 ] && pass "$name: pip install . fails and pip shows the message"
  [ $missing = 0 ] || tail_of "$log"
  if "$PY" -m pip show -q fasthealth >/dev/null 2>&1 \
      || (cd "$WORK" && "$PY" -c "import fasthealth" >/dev/null 2>&1); then
    fail "$name: fasthealth is installed after the failed pip install ."
  else
    pass "$name: nothing installed"
  fi
}

echo "== install check in $WORK (torch $TORCH_VERSION)"
mkdir -p "$SRC"
git -C "$ROOT" ls-files -z | (cd "$ROOT" && while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"; done) | tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -
"$PYTHON" -m venv "$WORK/venv" || { echo "FAIL: cannot create a venv"; exit 1; }

expect_refused "(a) without torch" "$WORK/a.log"

if ! "$PY" -m pip install -q "torch==$TORCH_VERSION" numpy >"$WORK/torch.log" 2>&1; then
  fail "pip install torch==$TORCH_VERSION numpy"; tail_of "$WORK/torch.log"; exit 1
fi

expect_refused "(c) with torch $TORCH_VERSION installed" "$WORK/c.log"

t0=$SECONDS
if (cd "$SRC" && "$PY" -m pip install --no-build-isolation .) >"$WORK/b.log" 2>&1; then
  pass "(b) pip install --no-build-isolation . ($((SECONDS - t0)) s)"
  if (cd "$WORK" && SRC=$(realpath "$SRC") "$PY" - <<'EOF'
import os
import warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fasthealth as fh
import torch

assert not os.path.realpath(fh.__file__).startswith(os.environ["SRC"] + os.sep), fh.__file__
told = [str(w.message) for w in caught if "fasthealth" in str(w.message)]
assert not told, told
assert fh.ops.compiled.C is not None, fh.ops.compiled.load_error
assert "cpu" in fh.available_backends(), fh.available_backends()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
model(torch.randn(3, 8)).square().sum().backward()
grads = [p.grad.flatten() for p in model.parameters()]
s = fh.check_grads(model, backend="cpu")
assert s.ok and s.nonfinite() == [], s.summary()
want = torch.linalg.vector_norm(torch.cat(grads).double()).item()
assert abs(s.total.norm.item() - want) <= 1e-5 * want, (s.total.norm.item(), want)
model[1].weight.grad[0, 1] = float("nan")
s = fh.check_grads(model, backend="cpu")
assert not s.ok and s.nonfinite() == ["1.weight"], s.nonfinite()
print(f"fasthealth {fh.__file__}: backends {fh.available_backends()}, torch {torch.__version__}, "
      f"cpu kernel {fh.ops.compiled.cpu_isa()}")
EOF
  ) >"$WORK/import.log" 2>&1; then
    pass "(b) compiled cpu backend loads outside the source tree; check_grads finds the norm and the NaN"
    sed 's/^/    /' "$WORK/import.log"
  else
    fail "(b) the installed fasthealth"; tail_of "$WORK/import.log"
  fi
else
  fail "(b) pip install --no-build-isolation . ($((SECONDS - t0)) s)"; tail_of "$WORK/b.log"
fi

# (d) the sdist holds every file under csrc/ (setuptools adds them from the extension's depends)
if (cd "$SRC" && "$PY" setup.py -q sdist -d "$WORK/dist") >"$WORK/sdist.log" 2>&1; then
  missing=$(comm -23 <(git -C "$ROOT" ls-files csrc | sort) \
    <(tar -tzf "$WORK"/dist/*.tar.gz | sed 's|^[^/]*/||' | sort))
  if [ -z "$missing" ]; then pass "(d) the sdist carries every file under csrc/"
  else fail "(d) the sdist lacks: $missing"; fi
else
  fail "(d) python setup.py sdist"; tail_of "$WORK/sdist.log"
fi

echo "== install check: $([ $FAILED = 0 ] && echo PASS || echo FAIL) in $((SECONDS - START)) s"
exit $FAILED
