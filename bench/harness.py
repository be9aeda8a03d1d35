"""The CPU benchmark: fasthealth.check_grads against what people run instead.

Providers (bench/baselines.py holds the baselines; tests check they compute what they say):
  fasthealth   fh.check_grads(model): every statistic of docs/spec.md section 2, per tensor
               and total
  naive        per tensor isnan().any(), isinf().any(), norm(), each with .item()
  naive_full   the same loop computing the full statistic set, one .item() per value
  foreach      torch._foreach_norm plus a per-tensor non-finite count, one sync at the end
  total_norm   torch.nn.utils.get_total_norm plus isfinite: the one-line alternative (one
               statistic and one flag, where fasthealth computes 18 per tensor and the total)
  read_limit   torch.sum over one flat buffer of the same bytes: the memory read limit
  floor_flat   fasthealth's own pass over that flat buffer with a kernel that only reads
  floor        the same over the model's gradients: check_grads(model)'s gather, chunks and
               prefetches, without the statistics (the roofline's layout term)

Roofline (printed and saved per case): the read limit (memory, as one flat buffer), the compute
roof (the kernel's rate with its data in L2, one thread, times the threads), and fasthealth's
time split into reading one buffer, reading these tensors (floor - floor_flat: their number and
scatter), and the statistics with the Python around them (fasthealth - floor). The speed-up over
get_total_norm that any check reading every byte could reach is get_total_norm's time over the
read limit: where that is under the goal, memory bounds it, not the kernel.

Method: every provider runs once per round, rounds interleave providers (in a rotating order)
so machine noise hits all alike; a warm-up round first; the median over rounds is reported,
with GB/s of gradient bytes read. Results go to JSON and a PNG plot, in build/bench-results/
(git ignores it) unless ``--record`` puts them into bench/results/, the figures the docs cite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: bench/ modules

import baselines  # noqa: E402
import bench_nonfinite  # noqa: E402
from read_probe import read_floor  # noqa: E402

from fasthealth import check_grads  # noqa: E402
from fasthealth.ops import compiled  # noqa: E402
from fasthealth.selftest import GPT2_SMALL, gpt2_shapes  # noqa: E402


def small_shapes(n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[int, ...]]:
    """n 1-D shapes with sizes log-uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    sizes = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).round().long()
    return [(int(s),) for s in sizes]


class _GradModel(torch.nn.Module):
    """A module whose parameters carry random gradients of the given shapes."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.params = torch.nn.ParameterList()
        for s in shapes:
            p = torch.nn.Parameter(torch.empty(s, dtype=dtype), requires_grad=True)
            p.grad = (torch.randn(s, generator=g) * 0.02).to(dtype)
            self.params.append(p)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params]


def cases(quick: bool) -> list[dict]:
    out = [
        dict(name="gpt2-small", dtype=torch.float32, shapes=gpt2_shapes(**GPT2_SMALL)),
        dict(name="gpt2-small", dtype=torch.bfloat16, shapes=gpt2_shapes(**GPT2_SMALL)),
        dict(name="4000-small", dtype=torch.float32, shapes=small_shapes(4000, 4096, 65536)),
        dict(name="4000-tiny", dtype=torch.float32, shapes=small_shapes(4000, 64, 4096)),
    ]
    if quick:  # a smoke run: same code paths, small sizes
        out = [
            dict(name="gpt2-mini", dtype=torch.float32,
                 shapes=gpt2_shapes(vocab=2000, ctx=128, d=64, layers=2)),
            dict(name="400-small", dtype=torch.bfloat16, shapes=small_shapes(400, 64, 4096)),
        ]
    return out


class _FlatModel(torch.nn.Module):
    """One parameter whose gradient is `flat`: the read floor over one buffer."""

    def __init__(self, flat: torch.Tensor):
        super().__init__()
        # the parameter's own values are never read: a stride-0 tensor of flat's shape
        self.p = torch.nn.Parameter(torch.empty(1, dtype=flat.dtype).expand(flat.shape))
        self.p.grad = flat


def providers(model: _GradModel, flat: torch.Tensor) -> dict[str, Callable[[], object]]:
    grads = model.grads()
    # Rounds rotate this order, so each provider always follows the same one, and where a case
    # fits in the caches (4000 tiny, about 16 MB, fits in a server's L3) the one before sets
    # what is cached:
    # - fasthealth follows read_limit, and read_limit follows total_norm, as when the goals
    #   were set (after the naive loop, which evicts the gradients' metadata, the 4000 tiny
    #   check runs nearly twice as long);
    # - foreach is followed by naive: a two-thread pass right after foreach is often several
    #   times slower, for reasons not found (not its freed memory), and the naive loop, tens of
    #   times slower than any such pass, absorbs it;
    # - the read floors follow fasthealth, on the caches it leaves: for 4000 tiny, `floor` is
    #   then warmer than fasthealth was, and the roofline's split gives the statistics more
    #   than their share.
    base = {
        # .ok forces the one host sync fasthealth needs to act on its result
        "fasthealth": lambda: check_grads(model).ok,
        "foreach": lambda: baselines.foreach_norm_isfinite(grads)[1].item(),
        "naive": lambda: baselines.naive_loop(grads),
        "naive_full": lambda: baselines.naive_full_loop(grads),
        "total_norm": lambda: baselines.total_norm_isfinite(grads).item(),
        "read_limit": lambda: baselines.read_limit(flat).item(),
    }
    floor, floor_flat = read_floor(model), read_floor(_FlatModel(flat))
    if floor is None or floor_flat is None:
        return base
    out = {"fasthealth": base.pop("fasthealth"), "floor": floor, "floor_flat": floor_flat}
    out.update(base)
    return out


def kernel_rate(dtype: torch.dtype, calls: int = 100, repeats: int = 7
                ) -> tuple[float, float] | None:
    """The compiled kernel's rate with its data in L2 on one thread, and the op's fixed cost
    per call: (G elements/s, us per call on 64 elements). A 64K-element tensor is checked
    `calls` times, and a 64-element one, median of `repeats`; the difference is the rate
    (bench/bench_kernel_rate.py runs it once per kernel variant)."""
    if compiled.C is None:
        return None
    op = torch.ops.fasthealth.multi_tensor_stats
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(65536, generator=g) * 0.02).to(dtype)
    small = (torch.randn(64, generator=g) * 0.02).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per = {}
        for name, t in (("big", big), ("small", small)):
            for _ in range(calls):  # warm-up
                op([t], math.inf, 0.0)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(calls):
                    op([t], math.inf, 0.0)
                ts.append((time.perf_counter() - t0) / calls)
            per[name] = statistics.median(ts)
    finally:
        torch.set_num_threads(threads)
    rate = (big.numel() - small.numel()) / max(per["big"] - per["small"], 1e-12) / 1e9
    return rate, per["small"] * 1e6


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="run", leave=False, file=sys.stderr)
    except ImportError:  # tqdm is optional: a plain counter on stderr

        class _Plain:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                print(f"\r{desc}: {self.n}/{total}", end="", file=sys.stderr, flush=True)

            def close(self):
                print(file=sys.stderr)

        return _Plain()


def run_case(case: dict, rounds: int, slow_rounds: int) -> list[dict]:
    model = _GradModel(case["shapes"], case["dtype"])
    grads = model.grads()
    flat = torch.cat([g.flatten() for g in grads])
    nbytes = flat.numel() * flat.element_size()
    provs = providers(model, flat)
    names = list(provs)
    # Before each timed call, a small two-thread reduction: the intra-op worker is then awake,
    # as it is right after a backward pass, whatever the provider before did (after the naive
    # loop's single-thread ops, waking it would be charged to the next provider, a large share
    # of a check of many tiny tensors).
    wake = torch.ones(1 << 16)
    times: dict[str, list[float]] = {n: [] for n in names}
    bar = _progress(rounds * len(names), f"{case['name']} {str(case['dtype'])[6:]}")
    for name in names:  # warm-up
        provs[name]()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if name == "naive_full" and r >= slow_rounds:  # seconds per run: fewer rounds
                bar.update()
                continue
            wake.sum()
            t0 = time.perf_counter()
            provs[name]()
            times[name].append(time.perf_counter() - t0)
            bar.update()
    bar.close()
    rows = []
    for name in names:
        ms = statistics.median(times[name]) * 1e3
        # Paired ratios: each round's time over the same round's read limit, so that a noisy
        # stretch of the machine hits both sides of a ratio.
        paired = sorted(a / b for a, b in zip(times[name], times["read_limit"]))
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        # and fasthealth's speed-up over the one-line alternative, round by round
        vs_total = sorted(b / a for a, b in zip(times["fasthealth"], times["total_norm"]))
        rows.append({
            "case": case["name"], "dtype": str(case["dtype"]).replace("torch.", ""),
            "provider": name, "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 3),
            "x_read_paired_median": round(statistics.median(paired), 3),
            "x_read_paired_iqr": [round(q[0], 3), round(q[2], 3)],
            "runs": len(times[name]), "tensors": len(grads), "elements": flat.numel(),
            "bytes": nbytes,
        })
        if name == "fasthealth":
            rows[-1]["x_faster_than_total_norm_paired_median"] = round(
                statistics.median(vs_total), 3)
    return rows


# The CPU goals, on the paired medians: fasthealth's time over the read limit, per case
READ_GOALS = {("gpt2-small", "float32"): 1.15, ("gpt2-small", "bfloat16"): 1.25,
              ("4000-small", "float32"): 1.5, ("4000-tiny", "float32"): 4.0}


def roofline(rows: list[dict], rates: dict[str, float | None]) -> list[dict]:
    """Per case, what bounds fasthealth: the memory roof (the read limit's GB/s), the compute
    roof (the kernel's L2 rate times the threads, in GB/s of this dtype), and fasthealth's time
    in read limits (paired medians) split into one flat buffer read by its own pass
    (floor_flat), the layout of these tensors (floor - floor_flat) and the statistics with the
    Python around them (fasthealth - floor); and the speed-up over get_total_norm that a check
    at the read limit would reach (get_total_norm's paired ratio to the read limit)."""
    out = []
    by = {(r["case"], r["dtype"], r["provider"]): r for r in rows}
    threads = torch.get_num_threads()
    for case, dtype in dict.fromkeys((r["case"], r["dtype"]) for r in rows):
        get = {p: by.get((case, dtype, p)) for p in
               ("fasthealth", "read_limit", "floor", "floor_flat", "total_norm")}
        if get["fasthealth"] is None or get["read_limit"] is None:
            continue
        x = {p: (r["x_read_paired_median"] if r else None) for p, r in get.items()}
        fh = get["fasthealth"]
        elem = fh["bytes"] / fh["elements"]
        rate = rates.get(dtype)
        roof = round(rate * threads * elem, 1) if rate else None
        mem = get["read_limit"]["gbps"]
        row = {"case": case, "dtype": dtype, "tensors": fh["tensors"],
               "mb": round(fh["bytes"] / 1e6, 1),
               "memory_roof_gbps": mem, "compute_roof_gbps": roof,
               "kernel_G_elements_per_s_per_thread": round(rate, 2) if rate else None,
               "fasthealth_gbps": fh["gbps"], "x_read": x["fasthealth"],
               "compute_below_memory": roof is not None and roof < mem}
        fastest_read = 1.0
        if x["floor"] is not None and x["floor_flat"] is not None:
            split = {"one_buffer": x["floor_flat"],
                     "layout": round(x["floor"] - x["floor_flat"], 3),
                     "statistics_and_python": round(x["fasthealth"] - x["floor"], 3)}
            row["split_x_read"] = split
            row["bound"] = max(split, key=split.get)
            fastest_read = min(1.0, x["floor_flat"])
        if x["total_norm"] is not None:
            row["total_norm_x_read"] = x["total_norm"]
            # the speed-up of a check that cost only the fastest read of these bytes measured
            row["total_norm_ceiling"] = round(x["total_norm"] / fastest_read, 3)
        out.append(row)
    return out


BOUND_WORDS = {"one_buffer": "memory bandwidth", "layout": "the tensors' number and scatter",
               "statistics_and_python": "the statistics and the Python around them"}


def roofline_text(roof: list[dict]) -> str:
    lines = ["roofline (ratios: paired medians over the read limit)"]
    for r in roof:
        comp = (f"compute roof {r['compute_roof_gbps']:.0f} GB/s "
                f"({r['kernel_G_elements_per_s_per_thread']:.1f} G el/s a thread in L2)"
                if r["compute_roof_gbps"] else "compute roof not measured")
        below = " (below the memory roof!)" if r["compute_below_memory"] else ""
        lines.append(f"  {r['case']} {r['dtype']} ({r['tensors']} tensors, {r['mb']} MB): "
                     f"memory roof {r['memory_roof_gbps']:.1f} GB/s, {comp}{below}; "
                     f"fasthealth {r['fasthealth_gbps']:.1f} GB/s = {r['x_read']:.2f}x")
        sp = r.get("split_x_read")
        if sp:
            lines.append(f"    = {sp['one_buffer']:.2f} reading one buffer (own pass, no "
                         f"statistics) + {sp['layout']:.2f} reading these {r['tensors']} tensors "
                         f"instead + {sp['statistics_and_python']:.2f} statistics and Python; "
                         f"largest: {BOUND_WORDS[r['bound']]}")
        if "total_norm_ceiling" in r:
            lines.append(f"    get_total_norm + isfinite takes {r['total_norm_x_read']:.2f}x: a "
                         f"check costing only the fastest read measured would be "
                         f"{r['total_norm_ceiling']:.2f}x faster than it")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[dict]:
    """The goals, read off the rows: the paired ratio to the read limit per case, 1.6x faster
    than get_total_norm + isfinite in every case, 15x faster than the naive loop. Each goal
    says what bounds it (`bound`): for the read limit, how much of it reading these tensors
    without any statistics takes; for get_total_norm, the most a check at the read limit
    could reach."""
    out = []
    by = {(r["case"], r["dtype"], r["provider"]): r for r in rows}
    for (case, dtype, prov), r in by.items():
        if prov != "fasthealth":
            continue
        floor = by.get((case, dtype, "floor"))
        if (case, dtype) in READ_GOALS:
            g = {"goal": f"{case} {dtype}: x read limit (paired)",
                 "value": r["x_read_paired_median"],
                 "met": r["x_read_paired_median"] <= READ_GOALS[(case, dtype)]}
            if floor:
                g["bound"] = (f"reading these tensors without statistics: "
                              f"{floor['x_read_paired_median']:.2f}x")
            out.append(g)
        if "x_faster_than_total_norm_paired_median" in r:
            x = r["x_faster_than_total_norm_paired_median"]
            g = {"goal": f"{case} {dtype}: x faster than get_total_norm (paired)",
                 "value": x, "met": x >= 1.6}
            tn = by.get((case, dtype, "total_norm"))
            flat = by.get((case, dtype, "floor_flat"))
            if tn:
                best = min(1.0, flat["x_read_paired_median"]) if flat else 1.0
                g["bound"] = (f"at most {tn['x_read_paired_median'] / best:.2f}x for a check "
                              f"costing only the fastest read")
            out.append(g)
        naive = by.get((case, dtype, "naive"))
        if naive:
            x = round(naive["ms"] / r["ms"], 1)
            out.append({"goal": f"{case} {dtype}: x faster than the naive loop", "value": x,
                        "met": x >= 15})
    return out


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        # the host is shared: how busy it was when the run began (1, 5, 15 minutes)
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel_isa": compiled.cpu_isa(),
        "kernel_isas_runnable": compiled.C.cpu_isas() if compiled.C is not None else [],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<12} {'dtype':<9} {'provider':<11} {'ms':>10} {'GB/s':>8} "
             f"{'x read':>8} {'paired (IQR)':>20} {'speedup':>8}"]
    for case in dict.fromkeys((r["case"], r["dtype"]) for r in rows):
        rs = [r for r in rows if (r["case"], r["dtype"]) == case]
        by = {r["provider"]: r for r in rs}
        for r in rs:
            vs_read = r["ms"] / by["read_limit"]["ms"]
            speed = r["ms"] / by["fasthealth"]["ms"]
            iqr = r["x_read_paired_iqr"]
            paired = f"{r['x_read_paired_median']:.2f} ({iqr[0]:.2f}-{iqr[1]:.2f})"
            lines.append(f"{r['case']:<12} {r['dtype']:<9} {r['provider']:<11} {r['ms']:>10.3f} "
                         f"{r['gbps']:>8.2f} {vs_read:>8.2f} {paired:>20} {speed:>7.1f}x")
    lines.append("x read: median time over the read limit's median; paired: median (and "
                 "quartiles) of each round's\ntime over that round's read limit; speedup: "
                 "provider time over fasthealth's")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    groups = list(dict.fromkeys((r["case"], r["dtype"]) for r in rows))
    provs = [p for p in dict.fromkeys(r["provider"] for r in rows)
             if p not in ("floor", "floor_flat")]  # the roofline's probes: in the table only
    colors = {"fasthealth": "#d62728", "read_limit": "#7f7f7f", "naive": "#1f77b4",
              "naive_full": "#9467bd", "foreach": "#2ca02c", "total_norm": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(2.6 * len(groups) + 2, 4.8))
    width = 0.8 / len(provs)
    for j, p in enumerate(provs):
        xs, ys = [], []
        for i, g in enumerate(groups):
            r = next((r for r in rows if (r["case"], r["dtype"]) == g and r["provider"] == p),
                     None)
            if r:
                xs.append(i + (j - (len(provs) - 1) / 2) * width)
                ys.append(r["ms"])
        bars = ax.bar(xs, ys, width, label=p, color=colors.get(p))
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.3g}", (b.get_x() + b.get_width() / 2, y), ha="center",
                        va="bottom", fontsize=7, rotation=90, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["ms"] for r in rows) * 8)  # room for the labels above the bars
    ax.set_ylabel("ms per check (median, log scale)")
    ax.set_xticks(range(len(groups)), [f"{c}\n{d}" for c, d in groups])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncol=len(provs), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_roofline(roof: list[dict], path: Path, title: str) -> bool:
    """fasthealth's time per case in read limits, stacked as the roofline splits it, with
    the case's goal (READ_GOALS) marked."""
    rows = [r for r in roof if "split_x_read" in r]
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    parts = [("one_buffer", "one buffer, fasthealth's own pass without statistics", "#7f7f7f"),
             ("layout", "+ reading these tensors instead of one buffer", "#1f77b4"),
             ("statistics_and_python", "+ the statistics and the Python around them",
              "#d62728")]
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.75 * len(rows)))
    labels = [f"{r['case']} {r['dtype']}\n({r['tensors']} tensors, {r['mb']} MB)" for r in rows]
    ys = list(range(len(rows)))[::-1]
    for key, label, color in parts:
        left = [sum(max(r["split_x_read"][k], 0.0) for k, _, _ in parts[:[p[0] for p in
                                                                         parts].index(key)])
                for r in rows]
        width = [max(r["split_x_read"][key], 0.0) for r in rows]
        ax.barh(ys, width, left=left, color=color, label=label, height=0.6)
    right = 0.0
    for y, r in zip(ys, rows):
        end = sum(max(v, 0.0) for v in r["split_x_read"].values())
        goal = READ_GOALS.get((r["case"], r["dtype"]))
        if goal:
            ax.plot([goal, goal], [y - 0.38, y + 0.38], color="black", lw=1.5,
                    label="goal" if y == ys[0] else None)
        at = max(end, goal or 0.0)
        ax.annotate(f"{r['x_read']:.2f}x", (at, y), xytext=(5, 0), textcoords="offset points",
                    va="center", fontsize=8)
        right = max(right, at)
    ax.axvline(1.0, color="#7f7f7f", lw=0.8, ls="--")
    ax.set_xlim(0, right * 1.12)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlabel("time over the read limit (torch.sum of one flat buffer), paired medians")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# Where results go: a run's own into the checkout's build/ (git ignores it), the ones the docs
# cite into bench/results only when asked (--record, `make bench RECORD=1`)
ROOT = Path(__file__).resolve().parents[1]
SCRATCH, RECORDED = ROOT / "build" / "bench-results", ROOT / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fasthealth bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help=f"folder for cpu.json and the plots (default: {SCRATCH}, "
                    "which git ignores)")
    ap.add_argument("--record", action="store_true",
                    help=f"write them into {RECORDED}, the measurements the docs cite (tracked)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case")
    ap.add_argument("--slow-rounds", type=int, default=5, help="rounds for naive_full")
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    ap.add_argument("--case", action="append", help="only these cases (e.g. gpt2-small:bfloat16)")
    args = ap.parse_args(argv)
    if args.record and args.out is not None:
        ap.error("--record writes into bench/results; give --out or --record, not both")
    info = machine()
    print(f"fasthealth CPU benchmark on {info['cpu']} ({info['cores']} cores, "
          f"{info['torch_threads']} torch threads, load average "
          f"{' '.join(map(str, info['load_average']))}), torch {info['torch']}, "
          f"kernel {info['kernel_isa']}")
    rows: list[dict] = []
    for case in cases(args.quick):
        key = f"{case['name']}:{str(case['dtype']).replace('torch.', '')}"
        if args.case and key not in args.case and case["name"] not in args.case:
            continue
        rows += run_case(case, args.rounds, min(args.slow_rounds, args.rounds))
    rates = {}
    for dt in dict.fromkeys(c["dtype"] for c in cases(args.quick)):
        measured = kernel_rate(dt)
        rates[str(dt).replace("torch.", "")] = measured[0] if measured else None
    roof = roofline(rows, rates)
    print(table(rows))
    print(roofline_text(roof))
    for g in goals(rows):
        why = f"  ({g['bound']})" if "bound" in g else ""
        print(f"goal: {g['goal']:<52} {g['value']:>7} {'met' if g['met'] else 'NOT MET'}{why}")
    out = RECORDED if args.record else Path(args.out) if args.out is not None else SCRATCH
    out.mkdir(parents=True, exist_ok=True)
    stem = "cpu-quick" if args.quick else "cpu"
    (out / f"{stem}.json").write_text(json.dumps({"machine": info, "rows": rows,
                                                  "roofline": roof, "goals": goals(rows)},
                                                 indent=1))
    title = (f"fasthealth check_grads vs baselines, {info['cpu']}, {info['torch_threads']} "
             f"threads, torch {info['torch']}")
    plotted = plot(rows, out / f"{stem}.png", title)
    plot_roofline(roof, out / f"{stem}-roofline.png",
                  f"Where fasthealth's time goes, {info['cpu']}, kernel {info['kernel_isa']}, "
                  f"{info['date']}")
    print(f"wrote {out / f'{stem}.json'}" + (f" and {out / f'{stem}.png'}, "
                                              f"{out / f'{stem}-roofline.png'}" if plotted
                                              else ""))
    # the same gradients holding NaN/Inf against finite ones (its own JSON)
    bench_nonfinite.main(["--out", str(out / f"cpu_nonfinite{'-quick' if args.quick else ''}.json"),
                          "--label", "make bench", "--rounds", str(args.rounds)]
                         + (["--quick"] if args.quick else []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
