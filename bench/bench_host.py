"""Host cost per call of the GPU paths, measured on CPU tensors through the same code.

No GPU is needed: every part of a call that runs on the host is timed with the device work
taken out.

- ``front``: ``fh.multi_tensor_stats(tensors)`` from the public call to the op and back
  (backend choice, the table's views, the names), with the op itself replaced by a stub that
  returns a ready table. The CUDA and Triton paths share it.
- ``cuda_prep``: the CUDA launcher's own host work per call (each input checked, float8 and
  non-dense inputs staged, the work list's key built and looked up in the cache), through
  ``fasthealth._C.work_list``, the very function ``csrc/cuda/tensor_stats.cu`` calls, here
  on CPU tensors. Absent in builds that predate it (then ``cuda_prep`` is null).
- ``dispatch``: the compiled op called through ``torch.ops`` on N empty CPU tensors: the
  dispatcher's conversion of the tensor list plus the CPU kernel's per-input checks, an upper
  bound on what the op's dispatch adds to ``cuda_prep``.
- ``dispatch_checks``: the op through ``torch.ops`` on the same N tensors with a complex one
  last, so that the CPU launcher's per-input checks run over all of them and raise before any
  kernel: the dispatcher's handling of the tensor list plus one check loop (as the CUDA
  launcher's), and one exception. What an eager CUDA call paid before it skipped the
  dispatcher (``_C.cuda_table`` takes the list as ``cuda_prep``'s ``work_list`` does).
- ``triton_prep``: the Triton launcher with its kernels replaced by no-ops: everything
  Python does per call up to the launches (inputs, plan lookup, grid).

The GPU's own launch costs (2 to 4 kernel launches, a few microseconds each) are not in these
numbers. Each figure is the median over ``--repeats`` rounds of the per-call time of a batch
of calls (and the fastest round, ``*_min_us``: the machine may be shared); the rounds
interleave the parts.

    python bench/bench_host.py --out bench/results/host_after.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the launcher as on a GPU (chunk sizes, grid)
# this checkout's fasthealth, whatever an editable install elsewhere maps the name to
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fasthealth as fh  # noqa: E402
from fasthealth import ops  # noqa: E402
from fasthealth.ops.layout import TABLE_WIDTH  # noqa: E402

SIZES = (10, 100, 1000, 4000)


class _NoLaunch:
    """Stands for a @triton.jit kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def tensors_of(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(64 + (i * 37) % 1000, generator=g) for i in range(n)]


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3  # microseconds per call


def parts_for(n: int):
    ts = tensors_of(n)
    empty = [torch.empty(0) for _ in range(n)]
    table = torch.zeros(n + 1, TABLE_WIDTH, dtype=torch.float64)
    real_run = ops.run

    def front():
        ops.run = lambda *a, **k: table
        try:
            s = fh.multi_tensor_stats(ts)
        finally:
            ops.run = real_run
        return s

    def dispatch():
        return torch.ops.fasthealth.multi_tensor_stats(empty, math.inf, 0.0)

    bad = ts[:-1] + [torch.zeros(1, dtype=torch.complex64)]

    def dispatch_checks():
        try:
            torch.ops.fasthealth.multi_tensor_stats(bad, math.inf, 0.0)
        except (TypeError, RuntimeError):
            return None
        raise AssertionError("the complex input was accepted")

    parts = {"front": front, "dispatch": dispatch, "dispatch_checks": dispatch_checks}
    C = ops.compiled.C
    if C is not None and hasattr(C, "work_list"):
        cuda_limits = C.cuda_plan_limits(396)  # an H200's chunk kernel: 132 SMs x 3 blocks

        def cuda_prep():
            return C.work_list(ts, False, False, cuda_limits, [])

        parts["cuda_prep"] = cuda_prep
    try:
        from fasthealth.triton_kernels import tensor_stats as tk
    except ImportError:
        tk = None
    if tk is not None:
        stub = _NoLaunch()
        real = (tk._chunk_stats_kernel, tk._merge_chunks_kernel, tk._merge_finalize_kernel)

        def triton_prep():
            tk._chunk_stats_kernel = tk._merge_chunks_kernel = tk._merge_finalize_kernel = stub
            try:
                return tk.multi_tensor_stats_triton(ts)
            finally:
                tk._chunk_stats_kernel, tk._merge_chunks_kernel, tk._merge_finalize_kernel = real

        parts["triton_prep"] = triton_prep
    return parts


def _where(package: Path) -> str:
    """The package measured: "fasthealth" when it is this checkout's, else its path."""
    here = Path(__file__).resolve().parent.parent / "fasthealth"
    return "fasthealth" if package.resolve() == here else str(package)


def machine() -> dict:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "commit": rev, "fasthealth": _where(Path(fh.__file__).parent),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host path is single threaded; keep the kernel's pool out
    rows = []
    for n in SIZES:
        parts = parts_for(n)
        calls = max(5, 4000 // n)
        for fn in parts.values():  # warm-up: caches built, lazy imports done
            for _ in range(3):
                fn()
        samples: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(args.repeats):
            for k, fn in parts.items():
                samples[k].append(timed(fn, calls))
        row = {"tensors": n, "calls_per_round": calls, "repeats": args.repeats}
        for k in ("front", "cuda_prep", "dispatch", "dispatch_checks", "triton_prep"):
            row[k + "_us"] = round(statistics.median(samples[k]), 2) if k in samples else None
            row[k + "_min_us"] = round(min(samples[k]), 2) if k in samples else None
        goal = 10 + 0.05 * n
        row["goal_us"] = goal
        if row["cuda_prep_us"] is not None:  # (plus the op's dispatch: see `dispatch`)
            row["cuda_host_us"] = round(row["front_us"] + row["cuda_prep_us"], 2)
            row["cuda_host_min_us"] = round(row["front_min_us"] + row["cuda_prep_min_us"], 2)
        row["triton_host_us"] = (round(row["front_us"] + row["triton_prep_us"], 2)
                                 if row["triton_prep_us"] is not None else None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"label": args.label, "machine": machine(), "rows": rows,
              "how": __doc__.split("\n\n")[1:3]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
