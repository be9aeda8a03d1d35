"""The CPU kernel on gradients that hold NaN/Inf, against the same gradients all finite.

The goal: a check of NaN-laden gradients (the step that matters) should run at >= 80% of
the finite speed. Per dtype, GPT-2-small-shaped gradients (bench/harness.py's case) in five
variants, each its own set of tensors:
  finite     randn * 0.02, as harness.py
  one_nan    the same with one NaN per tensor, at a random position
  all_nan    every element NaN
  all_inf    every element +inf
  mix        1% each of NaN, +inf and -inf scattered among the finite values

Method (harness.py's): `check_grads(model).ok` (the call and the one sync a caller needs to act),
a warm-up round, then rounds that run every variant once in a rotating order, each call after
the same small two-thread reduction; the median over rounds is reported, and each variant's
speed relative to `finite` as the median over rounds of that round's finite time over its own
(paired, so that the shared machine's noise hits both alike), with its quartiles. Every
variant's table is compared once with fasthealth/ops/reference.py (exact fields equal, the
largest relative error of the others), so a fast wrong answer cannot pass.

`python bench/bench_nonfinite.py --label after` writes (or adds to) bench/results/
cpu_nonfinite.json under that label; `--compare OLD_TREE NEW_TREE` runs this script with each
tree first on PYTHONPATH (its built extension), alternately, `--repeat` times each, in one
session, and keeps every run plus the median per label (the "before" and "after" of a change).
`make bench` (harness.py) runs it once with its own label.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fasthealth as fh
from fasthealth import check_grads
from fasthealth.ops import compiled
from fasthealth.ops.layout import COL
from fasthealth.ops.reference import tensor_stats_row
from fasthealth.selftest import GPT2_SMALL, gpt2_shapes

VARIANTS = ("finite", "one_nan", "all_nan", "all_inf", "mix")
GOAL = 0.80  # non-finite at >= 80% of the finite speed
EXACT = ("numel", "nan_count", "posinf_count", "neginf_count", "inf_count", "zero_count",
         "min", "max", "finite_min", "finite_max", "amax", "all_finite")


def make_grads(finite: list[torch.Tensor], variant: str, seed: int = 0) -> list[torch.Tensor]:
    """`finite`'s tensors, copied, with the variant's non-finite values planted."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in finite:
        t = t.clone()
        flat = t.view(-1)
        if variant == "one_nan":
            flat[int(torch.randint(flat.numel(), (1,), generator=g))] = math.nan
        elif variant == "all_nan":
            flat.fill_(math.nan)
        elif variant == "all_inf":
            flat.fill_(math.inf)
        elif variant == "mix":
            u = torch.rand(flat.numel(), generator=g)
            flat[u < 0.01] = math.nan
            flat[(u >= 0.01) & (u < 0.02)] = math.inf
            flat[(u >= 0.02) & (u < 0.03)] = -math.inf
        out.append(t)
    return out


class _GradModel(torch.nn.Module):
    def __init__(self, grads: list[torch.Tensor]):
        super().__init__()
        self.params = torch.nn.ParameterList()
        for gr in grads:
            p = torch.nn.Parameter(torch.empty(1, dtype=gr.dtype).expand(gr.shape))
            p.grad = gr
            self.params.append(p)


TOLERANCE = {"norm": 1e-5, "finite_norm": 1e-5, "finite_mean": 1e-5, "finite_std": 1e-4}


def accuracy(grads: list[torch.Tensor]) -> dict:
    """The fused table against the float64 reference, tensor by tensor: the exact fields
    (docs/spec.md section 2) equal, and the largest error of the others in the spec's units
    (relative; finite_mean in units of mean(|finite x|)), with whether all are within it."""
    table = fh.multi_tensor_stats(grads).raw.double()
    exact_ok, worst = True, dict.fromkeys(TOLERANCE, 0.0)
    for i, t in enumerate(grads):
        got, ref = table[i].tolist(), tensor_stats_row(t).double().tolist()
        for name in EXACT:
            a, b = got[COL[name]], ref[COL[name]]
            exact_ok &= (math.isnan(a) and math.isnan(b)) or a == b
        d = t.double().flatten()
        f = d[torch.isfinite(d)]
        mean_abs = f.abs().mean().item() if f.numel() else 0.0
        for name in TOLERANCE:
            a, b = got[COL[name]], ref[COL[name]]
            if not (math.isfinite(a) and math.isfinite(b)):
                err = 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else math.inf
            else:
                scale = mean_abs if name == "finite_mean" else abs(b)
                err = abs(a - b) / scale if scale > 0 else (0.0 if a == b else math.inf)
            worst[name] = max(worst[name], err)
    return {"exact_fields_equal": bool(exact_ok),
            "max_err": {k: float(f"{v:.3g}") for k, v in worst.items()},
            "within_spec": all(worst[k] <= tol for k, tol in TOLERANCE.items())}


def run(dtype: torch.dtype, rounds: int, quick: bool, check: bool) -> list[dict]:
    shapes = gpt2_shapes(**(dict(vocab=2000, ctx=128, d=64, layers=2) if quick else GPT2_SMALL))
    g = torch.Generator().manual_seed(0)
    finite = [(torch.randn(s, generator=g) * 0.02).to(dtype) for s in shapes]
    grads = {v: make_grads(finite, v) for v in VARIANTS}
    del finite
    models = {v: _GradModel(g) for v, g in grads.items()}
    calls = {v: (lambda m=m: check_grads(m).ok) for v, m in models.items()}
    wake = torch.ones(1 << 16)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:  # warm-up
        calls[v]()
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            wake.sum()
            t0 = time.perf_counter()
            calls[v]()
            times[v].append(time.perf_counter() - t0)
    elements = sum(math.prod(s) for s in shapes)
    nbytes = elements * torch.empty(0, dtype=dtype).element_size()
    rows = []
    for v in VARIANTS:
        ms = statistics.median(times[v]) * 1e3
        paired = sorted(f / t for f, t in zip(times["finite"], times[v]))
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        row = {"dtype": str(dtype).replace("torch.", ""), "variant": v, "ms": round(ms, 3),
               "gbps": round(nbytes / ms / 1e6, 2),
               "x_finite_speed_paired_median": round(statistics.median(paired), 3),
               "x_finite_speed_paired_iqr": [round(q[0], 3), round(q[2], 3)],
               "rounds": len(times[v]), "tensors": len(shapes), "elements": elements}
        if check:
            row.update(accuracy(grads[v]))
        if v != "finite":
            row["goal_met"] = row["x_finite_speed_paired_median"] >= GOAL
        rows.append(row)
    return rows


def machine() -> dict:
    return {"load_average": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernel_isa": compiled.cpu_isa(),
            "fasthealth": "fasthealth" if Path(fh.__file__).resolve().parent
            == Path(__file__).resolve().parent.parent / "fasthealth"
            else str(Path(fh.__file__).parent),  # the checkout's own, or where it was
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _exact(r: dict) -> str:
    if "exact_fields_equal" not in r:
        return "not checked"
    return "yes" if r["exact_fields_equal"] and r["within_spec"] else "NO"


def table(rows: list[dict]) -> str:
    lines = [f"{'dtype':<9} {'variant':<8} {'ms':>9} {'GB/s':>7} {'x finite (IQR)':>22} exact"]
    for r in rows:
        iqr = r["x_finite_speed_paired_iqr"]
        lines.append(f"{r['dtype']:<9} {r['variant']:<8} {r['ms']:>9.2f} {r['gbps']:>7.1f} "
                     f"{r['x_finite_speed_paired_median']:>8.2f} ({iqr[0]:.2f}-{iqr[1]:.2f})"
                     f"{'':>4} {_exact(r)}")
    return "\n".join(lines)


def _save(path: Path, label: str, run_: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("about", __doc__.strip().splitlines()[0])
    data.setdefault("runs", []).append({"label": label, **run_})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def summarize(path: Path) -> None:
    """Per label, the median over its runs of each variant's paired speed ratio and time."""
    data = json.loads(path.read_text())
    summary: dict = {}
    for run_ in data["runs"]:
        for r in run_["rows"]:
            key = f"{run_['label']} {r['dtype']} {r['variant']}"
            s = summary.setdefault(key, {"x_finite": [], "ms": [], "checked": []})
            s["x_finite"].append(r["x_finite_speed_paired_median"])
            s["ms"].append(r["ms"])
            if "exact_fields_equal" in r:
                s["checked"].append(_exact(r))
    for s in summary.values():
        s["runs"] = len(s["ms"])
        s["x_finite_median"] = round(statistics.median(s["x_finite"]), 3)
        s["ms_median"] = round(statistics.median(s["ms"]), 2)
    data["summary"] = summary
    path.write_text(json.dumps(data, indent=1))
    for k, s in summary.items():
        print(f"{k:<34} x finite {s['x_finite_median']:.2f} (runs {s['x_finite']}), "
              f"{s['ms_median']:.1f} ms, exact: {s['checked'] or 'not checked'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cpu_nonfinite.json")
    ap.add_argument("--label", default="run")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the comparison with the reference (minutes on GPT-2 sizes)")
    ap.add_argument("--compare", nargs=2, metavar=("OLD_TREE", "NEW_TREE"))
    ap.add_argument("--repeat", type=int, default=2, help="runs per tree with --compare")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.compare:
        for k in range(args.repeat):
            for label, tree in zip(("before", "after"), args.compare):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                print(f"== {label} ({tree}), run {k + 1} of {args.repeat}", flush=True)
                # the reference comparison once, on the first run of the new tree
                extra = (["--quick"] if args.quick else []) + (
                    [] if (k == 0 and label == "after" and not args.no_check) else ["--no-check"])
                subprocess.run([sys.executable, __file__, "--out", str(out), "--label", label,
                                "--rounds", str(args.rounds)] + extra, env=env, check=True)
        summarize(out)
        return 0
    info = machine()
    print(f"non-finite gradients, kernel {info['kernel_isa']}, {info['torch_threads']} threads, "
          f"load {info['load_average']}, fasthealth from {info['fasthealth']}", flush=True)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += run(dtype, args.rounds, args.quick, not args.no_check)
    print(table(rows))
    _save(out, args.label, {"machine": info, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
