"""GPU benchmark: fasthealth's cuda and triton backends against what people run instead, and the
read limit, on one device.

Providers (bench/baselines.py holds the baselines; tests check they compute what they say):
  cuda, triton         fh.multi_tensor_stats(tensors, backend=...): every statistic, per tensor
                       and total
  foreach_norm         plain torch._foreach_norm: the norms alone, no flag
  total_norm_isfinite  torch.nn.utils.get_total_norm + isfinite: the one-line alternative
  clip_grad_norm       torch.nn.utils.clip_grad_norm_ (max_norm inf): what training loops run
                       anyway; reads the gradients, then scales them in place
  foreach_isfinite     _foreach_norm plus a per-tensor non-finite count (3 launches a tensor)
  naive                per tensor isnan().any(), isinf().any(), norm(), each with .item()
  read_sum             torch.sum over one flat buffer of the same bytes: the read limit
  copy                 a copy of that buffer (GB/s count its reads and writes)
  compile              torch.compile of the reference, GPT-2 small only (--compile: minutes)

Two times per call. gpu_ms: the call captured in a CUDA graph, replayed many times between two
CUDA events, divided by the replays: the GPU's own time, no launch overhead (the naive loop
synchronizes, cannot be captured, and has none). wall_ms: a host timer over many calls with one
synchronize at the end: what a training step pays, launches included. Each provider is warmed
up first (fasthealth builds its work list; Triton compiles), checked once for host syncs under
torch.cuda.set_sync_debug_mode("error"), then timed in rounds that interleave the providers in
a rotating order; medians over the rounds. Inputs smaller than 8x the L2 cache alternate between
two copies so that the L2 does not flatter. GB/s count the gradient bytes read once.

Cases (most telling first, so that a run cut short keeps them): GPT-2 small (148 tensors,
124M), a 7B-like set of LLaMA shapes (291 tensors, 6.7B: 13.5 GB in bfloat16), 5000 small
tensors, GPT-2 XL (1.56B), in bfloat16 and float32; and the gradients of the step that matters,
GPT-2 small and 7B-like in bfloat16 holding NaN/Inf (case names ending in ``/nan-one``: one
NaN in every tensor; ``/nan-all``: nothing finite; ``/inf-mix``: 1% NaN and +-Inf spread out).

Every fused result is checked against the float64 reference on the same inputs in the same
run (``reference_check``: the count, min/max and range columns exactly, the norms within
1e-5 and the std within 1e-4 relative, as docs/spec.md section 2 promises); the row keeps the
largest errors and ``ref_ok``. A host sync is counted only when torch's sync debug mode
reports one; any other failure of the call is the provider's error. The clocks are warmed up
by a few seconds of matrix products before the first case (an idle GPU starts at low clocks),
and the fused providers' rows carry ``kernels``: the GPU time per call of each kernel they
launch (torch.profiler), so that a miss says which kernel it is.

The results file (bench/gpu_results.py: rows, machine, goals) is merged into and rewritten
atomically after every case.

    python bench/bench_gpu.py [--results bench/results/<card>.json] [--reps 5] [--quick]
        [--backends cuda,triton] [--no-baselines] [--plot bench/results/<card>.png]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ modules

import baselines  # noqa: E402
import gpu_results  # noqa: E402
from harness import small_shapes  # noqa: E402

import fasthealth as fh  # noqa: E402
from fasthealth.ops import reference, validation  # noqa: E402
from fasthealth.ops.layout import COL, COUNT_FIELDS, RANGE_FIELDS  # noqa: E402
from fasthealth.selftest import GPT2_SMALL, gpt2_shapes  # noqa: E402

BASELINES = ("foreach_norm", "total_norm_isfinite", "clip_grad_norm", "foreach_isfinite",
             "naive", "read_sum", "copy")
TARGET_S = 0.02  # host time per timed batch of calls or replays
MAX_CALLS = 200


def llama7b_shapes() -> list[tuple[int, ...]]:
    d, f, layers, vocab = 4096, 11008, 32, 32000
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]
    return shapes + [(d,), (vocab, d)]


def cases(quick: bool) -> list[tuple[str, str, list[tuple[int, ...]]]]:
    """(case, dtype, shapes), the ones the goals read first; a case name with ``/fill``
    (``FILLS``) times gradients that hold NaN/Inf."""
    shapes = {"gpt2-small": gpt2_shapes(**GPT2_SMALL), "7b-like": llama7b_shapes(),
              "5000-small": small_shapes(5000, 1024, 32768),
              "gpt2-xl": gpt2_shapes(50257, 1024, 1600, 48)}
    order = [("gpt2-small", "bfloat16"), ("7b-like", "bfloat16"),
             ("gpt2-small/nan-all", "bfloat16"), ("gpt2-small/nan-one", "bfloat16"),
             ("7b-like/nan-all", "bfloat16"), ("5000-small", "bfloat16"),
             ("gpt2-small/inf-mix", "bfloat16"), ("gpt2-small", "float32"),
             ("gpt2-small/nan-all", "float32"), ("7b-like", "float32"), ("gpt2-xl", "bfloat16"),
             ("5000-small", "float32"), ("gpt2-xl", "float32")]
    if quick:
        order = order[:1] + order[2:3] + order[5:6]
    return [(c, d, shapes[c.split("/")[0]]) for c, d in order]


FILLS = ("nan-one", "nan-all", "inf-mix")


def plant(t: torch.Tensor, fill: str | None, seed: int) -> torch.Tensor:
    """``t`` with the non-finite values of ``fill`` written in (in place): one NaN at a random
    element, every element NaN, or 1% of the elements NaN, +Inf and -Inf by turns."""
    if fill is None:
        return t
    flat = t.view(-1)
    g = torch.Generator(device="cpu").manual_seed(seed)
    if fill == "nan-all":
        return t.fill_(math.nan)
    if fill == "nan-one":
        flat[int(torch.randint(flat.numel(), (1,), generator=g))] = math.nan
        return t
    k = max(1, flat.numel() // 100)
    idx = torch.randperm(flat.numel(), generator=g)[:k].to(t.device)
    vals = torch.tensor([math.nan, math.inf, -math.inf], device=t.device, dtype=t.dtype)
    flat[idx] = vals[torch.arange(k, device=t.device) % 3]
    return t


class Inputs:
    """One copy of a case's gradients, and what the baselines read instead."""

    def __init__(self, shapes, dtype, flat: bool, holders: bool, fill: str | None = None):
        dev = torch.device("cuda")
        self.tensors = [plant(torch.randn(s, device=dev, dtype=dtype).mul_(0.02), fill, i)
                        for i, s in enumerate(shapes)]
        self.flat = torch.cat([t.flatten() for t in self.tensors]) if flat else None
        self.out = torch.empty_like(self.flat) if flat else None
        self.params = baselines.grad_holders(self.tensors) if holders else None


@functools.cache
def compiled_reference():
    return torch.compile(reference.multi_tensor_stats)


def provider(name: str, x: Inputs) -> Callable[[], object]:
    if name in gpu_results.FUSED:
        return lambda: fh.multi_tensor_stats(x.tensors, backend=name).raw
    return {
        "foreach_norm": lambda: baselines.foreach_norm(x.tensors),
        "total_norm_isfinite": lambda: baselines.total_norm_isfinite(x.tensors),
        "clip_grad_norm": lambda: baselines.clip_grad_norm(x.params),
        "foreach_isfinite": lambda: baselines.foreach_norm_isfinite(x.tensors),
        "naive": lambda: baselines.naive_loop(x.tensors),
        "read_sum": lambda: baselines.read_limit(x.flat),
        "copy": lambda: baselines.copy_limit(x.flat, x.out),
        "compile": lambda: compiled_reference()(x.tensors),
    }[name]


def host_syncs(fn: Callable[[], object]) -> bool:
    """Whether ``fn`` synchronizes with the device, by torch's sync debug mode: only its own
    error counts; any other error is the provider's, raised."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as exc:
        if "synchroniz" in str(exc):  # "called a synchronizing CUDA operation"
            return True
        raise
    finally:
        torch.cuda.set_sync_debug_mode("default")


EXACT = [i for name, i in COL.items() if name in COUNT_FIELDS or name in RANGE_FIELDS
         or name in ("min", "max", "finite_min", "finite_max", "amax", "all_finite")]
NORMS = [i for name, i in COL.items() if "norm" in name]
STDS = [i for name, i in COL.items() if "std" in name]
MEANS = [i for name, i in COL.items() if "mean" in name]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative error where both are finite (0 when none is); a NaN or Inf in
    one place and not the other counts as an error of 1."""
    finite = got.isfinite() & want.isfinite()
    same = (got == want) | (got.isnan() & want.isnan())
    err = torch.where(finite, (got - want).abs() / want.abs().clamp_min(1e-300),
                      torch.where(same, 0.0, 1.0))
    return float(err.max()) if err.numel() else 0.0


def reference_check(table: torch.Tensor, tensors: list[torch.Tensor]) -> dict:
    """A fused table (one row a tensor and the total) against the float64 reference of the
    same tensors, on the device: exact columns must match, norms within 1e-5 and std within
    1e-4 relative; the means' error is kept, judged by the tests (it is absolute, scaled)."""
    got = table.detach().double()
    want = reference.multi_tensor_stats(tensors).to(got.device, torch.float64)
    ex = got[:, EXACT]
    mismatches = int((~((ex == want[:, EXACT]) | (ex.isnan() & want[:, EXACT].isnan())))
                     .sum())
    norm, std, mean = (_rel(got[:, c], want[:, c]) for c in (NORMS, STDS, MEANS))
    return {"ref_exact_mismatches": mismatches, "ref_norm_rel": norm, "ref_std_rel": std,
            "ref_mean_rel": mean, "ref_ok": mismatches == 0 and norm <= 1e-5 and std <= 1e-4}


def kernel_times(fn: Callable[[], object], calls: int = 20) -> dict:
    """GPU microseconds per call of each kernel ``fn`` launches (torch.profiler), or the
    error that kept them from being measured."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        out = {}
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None)
            if us is None:
                us = getattr(e, "cuda_time_total", 0.0)
            if us and str(getattr(e, "device_type", "")).endswith("CUDA"):
                out[e.key[:80]] = round(us / calls, 2)
        return out
    except Exception as exc:  # the profiler is a diagnosis: its failure is not the row's
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def warm_clocks(seconds: float = 3.0) -> float:
    """Matrix products for ``seconds``: an idle GPU runs at low clocks and the first case
    would pay for its ramp. Returns the TFLOP/s of the last second (a sanity figure)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        n += 10
    return round(2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12, 1)


def wall_ms(fns: list[Callable[[], object]], calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / calls


def gpu_ms(graphs: list[torch.cuda.CUDAGraph], replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(replays):
        graphs[i % len(graphs)].replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def batch(one_ms: float) -> int:
    return max(1, min(MAX_CALLS, math.ceil(TARGET_S * 1e3 / max(one_ms, 1e-3))))


def measure(case: str, dtype_name: str, shapes, names: list[str], reps: int,
            l2: int) -> list[dict]:
    """Rows of one (case, dtype), one a provider: warm-up, sync check, capture, then ``reps``
    interleaved rounds of wall and graph timings. A provider that fails gets a row with its
    error; the others go on."""
    dtype = getattr(torch, dtype_name)
    numel = sum(math.prod(s) for s in shapes)
    nbytes = numel * dtype.itemsize
    copies = 2 if nbytes < 8 * l2 else 1
    flat = bool({"read_sum", "copy"} & set(names))
    fill = case.split("/")[1] if "/" in case else None
    sets = [Inputs(shapes, dtype, flat, "clip_grad_norm" in names, fill)
            for _ in range(copies)]
    base = {"case": case, "dtype": dtype_name, "tensors": len(shapes), "mb": round(nbytes / 1e6, 1)}
    fns, graphs, info, errors = {}, {}, {}, {}
    for p in names:
        try:
            fs = [provider(p, x) for x in sets]
            for f in fs:  # warm-up: work lists, Triton and torch.compile compilation
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fs[0]()
            torch.cuda.synchronize()
            one = (time.perf_counter() - t0) * 1e3
            info[p] = {"host_sync": host_syncs(fs[0]), "calls": batch(one)}
            if p in gpu_results.FUSED:
                info[p].update(reference_check(fs[0](), sets[0].tensors))
                info[p]["kernels"] = kernel_times(fs[0])
            fns[p] = fs
        except Exception as exc:  # a provider's failure is a result; the others go on
            errors[p] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
            continue
        if p == "naive":
            info[p]["no_graph"] = "synchronizes (.item()): wall time only"
            continue
        try:
            graphs[p] = [capture(f) for f in fs]
            gpu_ms(graphs[p], 1)  # the first replay uploads the graph
            info[p]["replays"] = batch(gpu_ms(graphs[p], 1))
        except Exception as exc:  # not capturable: wall time only, and say why
            graphs.pop(p, None)
            info[p]["no_graph"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
    walls = {p: [] for p in fns}
    gpus = {p: [] for p in graphs}
    order = list(fns)
    for r in range(reps if order else 0):
        for p in order[r % len(order):] + order[:r % len(order)]:
            walls[p].append(wall_ms(fns[p], info[p]["calls"]))
            if p in graphs:
                gpus[p].append(gpu_ms(graphs[p], info[p]["replays"]))
    rows = []
    for p in names:
        if p in errors:
            rows.append({**base, "provider": p, "error": errors[p]})
            print(f"{case:<11} {dtype_name:<9} {p:<20} ERROR {errors[p]}", flush=True)
            continue
        moved = 2 * nbytes if p == "copy" else nbytes
        w = statistics.median(walls[p])
        g = statistics.median(gpus[p]) if gpus.get(p) else None
        row = {**base, "provider": p, "gpu_ms": round(g, 4) if g else None,
               "wall_ms": round(w, 4), "gpu_gbps": round(moved / g / 1e6, 1) if g else None,
               "wall_gbps": round(moved / w / 1e6, 1), "rounds": reps, **info[p]}
        rows.append(row)
        print(f"{case:<11} {dtype_name:<9} {p:<20} gpu {g or float('nan'):9.4f} ms "
              f"{row['gpu_gbps'] or float('nan'):8.1f} GB/s   wall {w:9.4f} ms "
              f"{row['wall_gbps']:8.1f} GB/s", flush=True)
    return rows


def fake_measure(case: str, dtype_name: str, shapes, names: list[str], reps: int,
                 l2: int) -> list[dict]:
    """The dry run's stand-in (FASTHEALTH_BENCH_FAKE_SLEEP seconds a case, no GPU): rows of
    the same form, marked fake, so that the writes of a run cut short can be checked here."""
    time.sleep(float(os.environ.get("FASTHEALTH_BENCH_FAKE_SLEEP", "0.1")))
    mb = sum(math.prod(s) for s in shapes) * getattr(torch, dtype_name).itemsize / 1e6
    return [{"case": case, "dtype": dtype_name, "tensors": len(shapes), "mb": round(mb, 1),
             "provider": p, "gpu_ms": 1.0, "wall_ms": 1.0, "gpu_gbps": round(mb / 1e3, 1),
             "wall_gbps": round(mb / 1e3, 1), "rounds": reps, "host_sync": False,
             "fake": True} for p in names]


def machine(fake: bool) -> dict:
    if fake:
        return {"device": "fake (dry run, no GPU)", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(torch.device("cuda"))
    try:
        import triton  # the version only; the triton backend imports it anyway

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "l2_mb": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            "memory_gb": round(props.total_memory / 1e9, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version,
            "key": validation.machine_key(), "backends": fh.available_backends(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


METHOD = ("gpu_ms: the call captured in a CUDA graph, median over rounds of (events around N "
          "replays) / N; wall_ms: median over rounds of (host time of N calls, one synchronize "
          "at the end) / N; N sized to about 20 ms; providers interleaved in a rotating order; "
          "inputs under 8x L2 alternate between two copies; GB/s: gradient bytes read once "
          "(copy: read and written); host_sync: the call under "
          "torch.cuda.set_sync_debug_mode('error'), its own error only; ref_*: the fused "
          "table against the float64 reference of the same inputs; kernels: torch.profiler's "
          "GPU us per call of each kernel; clocks warmed up by matrix products first")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, help="the results file (bench/results/<card>.json, "
                    "named after this machine's GPU: gpu_results.card)")
    ap.add_argument("--copy", type=Path, action="append", default=[],
                    help="also write the results here")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds per case")
    ap.add_argument("--quick", action="store_true", help="GPT-2 small and 5000-small, bf16")
    ap.add_argument("--backends", default="cuda,triton",
                    help="the fasthealth backends to time (bench/gpu_check.sh: one a process)")
    ap.add_argument("--no-baselines", action="store_true",
                    help="skip the baselines and the read limit (timed in another process)")
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile of the reference, GPT-2 small (minutes)")
    ap.add_argument("--plot", type=Path, help="the bar plot of the results, at the end")
    ap.add_argument("--fake", action="store_true",
                    help="no GPU: fake rows (bench/gpu_check.sh's dry run)")
    args = ap.parse_args(argv)
    # a shell starts background jobs with SIGINT ignored and Python keeps that; the device
    # script's step limit interrupts with SIGINT, between cases' writes
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.results is None:
        args.results = Path("bench/results") / f"{gpu_results.card()}.json"
    paths = [args.results, *args.copy]
    names = [b for b in args.backends.split(",") if b in gpu_results.FUSED]
    if not args.fake:
        names = [b for b in names if b in fh.available_backends()]
    if not args.no_baselines:
        names += BASELINES
    run = fake_measure if args.fake else measure
    l2 = 0 if args.fake else getattr(torch.cuda.get_device_properties(0), "L2_cache_size",
                                     50 << 20)
    mach = machine(args.fake)
    if not args.fake:
        mach["warm_up_tflops"] = warm_clocks()
    gpu_results.update(paths, machine=mach, method=METHOD)
    for case, dtype, shapes in cases(args.quick):
        try:
            rows = run(case, dtype, shapes, names, args.reps, l2)
        except Exception as exc:  # the case's inputs did not fit, or the context is lost
            rows = [{"case": case, "dtype": dtype, "provider": p,
                     "error": f"{type(exc).__name__}: {exc}"[:300]} for p in names]
        if not args.fake:  # the case's inputs and graphs are gone: give their memory back
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        gpu_results.update(paths, rows)
        print(f"wrote {case} {dtype} ({len(rows)} rows) to {args.results}", flush=True)
    if args.compile and not args.fake:
        case, dtype, shapes = cases(False)[0]
        gpu_results.update(paths, measure(case, dtype, shapes, ["compile"], args.reps, l2))
        print(f"wrote {case} {dtype} compile to {args.results}", flush=True)
    doc = gpu_results.load(args.results)
    for g in doc.get("goals", []):
        met = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
        print(f"goal: {g['goal']:<78} {g['value']!s:>12} {met}")
    if args.plot:
        gpu_results.plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
