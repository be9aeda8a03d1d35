"""GPU benchmark: fasthealth's cuda and triton backends against the naive loop,
torch._foreach_norm, torch.compile of the reference, and the read limit, on one device.

Cases: GPT-2 small (148 tensors, 124M), GPT-2 XL (1.56B), a 7B-like set of LLaMA shapes, and
5000 small tensors, in bfloat16 and float32. CUDA-event timing, warm-up, medians of interleaved
repetitions; inputs smaller than 8x the L2 cache are rotated between two copies so that the L2
does not flatter. Writes bench/results/h200.json (a list of rows {case, dtype, provider, ms,
gbps}), h200_machine.json (device, versions, the GPU goals checked against the rows) and a
plot. `compile` (torch.compile of the reference) runs on GPT-2 small only: compiling the
reference over hundreds of tensors takes minutes of device time.

    python bench/bench_gpu.py [--out DIR] [--reps 20] [--quick]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ modules

import baselines  # noqa: E402
from harness import plot, small_shapes  # noqa: E402

import fasthealth as fh  # noqa: E402
from fasthealth.ops import reference  # noqa: E402
from fasthealth.selftest import gpt2_shapes  # noqa: E402


def llama7b_shapes():
    d, f, layers, vocab = 4096, 11008, 32, 32000
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]
    return shapes + [(d,), (vocab, d)]


def cases(quick):
    if quick:
        return [("gpt2-small", gpt2_shapes(50257, 1024, 768, 12)),
                ("5000-small", small_shapes(5000, 1024, 32768))]
    return [("gpt2-small", gpt2_shapes(50257, 1024, 768, 12)),
            ("gpt2-xl", gpt2_shapes(50257, 1024, 1600, 48)),
            ("7b-like", llama7b_shapes()),
            ("5000-small", small_shapes(5000, 1024, 32768))]


def time_ms(fn, arg):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(arg)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure(case, shapes, dtype, reps, l2, with_compile, backends=("cuda", "triton"),
            baseline=True):
    """Rows of one (case, dtype): every provider, interleaved, medians. ``backends``: the
    fasthealth backends to time; ``baseline``: the naive loop, _foreach_norm and the read
    limit too (once per device run, not once per backend process)."""
    dev = torch.device("cuda")
    nbytes = sum(torch.Size(s).numel() for s in shapes) * dtype.itemsize
    copies = 2 if nbytes < 8 * l2 else 1
    sets = [[torch.randn(s, device=dev, dtype=dtype) * 0.02 for s in shapes]
            for _ in range(copies)]
    flats = [torch.cat([t.flatten() for t in ts]) for ts in sets]
    provs = {}
    for b in backends:
        if b in fh.available_backends():
            provs[b] = lambda ts, b=b: fh.multi_tensor_stats(ts, backend=b).raw
    if baseline:
        provs["naive"] = baselines.naive_loop
        provs["foreach"] = baselines.foreach_norm_isfinite
    if with_compile:
        provs["compile"] = torch.compile(reference.multi_tensor_stats)
    times = {p: [] for p in provs}
    if baseline:
        times["read_limit"] = []
    for fn in provs.values():  # warm-up (and compilation)
        fn(sets[0])
    torch.cuda.synchronize()
    for r in range(reps):
        k = r % copies
        for p, fn in provs.items():
            times[p].append(time_ms(fn, sets[k]))
        if baseline:
            times["read_limit"].append(time_ms(baselines.read_limit, flats[k]))
    rows = []
    for p, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"case": case, "dtype": str(dtype).replace("torch.", ""), "provider": p,
                     "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 1)})
        print(f"{case:<11} {str(dtype)[6:]:<9} {p:<11} {ms:9.3f} ms "
              f"{nbytes / ms / 1e6:8.1f} GB/s", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--backends", default="cuda,triton",
                    help="the fasthealth backends to time (bench/gpu_check.sh: one a process)")
    ap.add_argument("--no-baselines", action="store_true",
                    help="skip the naive loop, _foreach_norm and the read limit")
    ap.add_argument("--compile-only", action="store_true",
                    help="only the torch.compile provider, on GPT-2 small")
    ap.add_argument("--rows", help="write the rows here (JSON) instead of h200.json/png")
    ap.add_argument("--merge", nargs="*", help="merge these rows files into --out and stop")
    args = ap.parse_args(argv)
    if args.merge is not None:
        return merge(args)
    props = torch.cuda.get_device_properties(torch.device("cuda"))
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    backends = [b for b in args.backends.split(",") if b]
    rows = []
    # results are written after every case: a run cut short by a time limit keeps what it did
    if not args.compile_only:
        for case, shapes in cases(args.quick):
            for dtype in (torch.bfloat16, torch.float32):
                rows += measure(case, shapes, dtype, args.reps, l2, False, backends,
                                not args.no_baselines)
                torch.cuda.empty_cache()
                write(rows, props, args)
    if args.compile_only or not (args.quick or args.no_compile):  # compiling takes a minute
        shapes = dict(cases(False))["gpt2-small"]
        for dtype in (torch.bfloat16, torch.float32):
            got = measure("gpt2-small", shapes, dtype, args.reps, l2, True, (), False)
            rows += [r for r in got if r["provider"] == "compile"]
            write(rows, props, args)
    for g in goals(rows):
        print(f"goal: {g['goal']:<58} {g['value']:>8} {'met' if g['met'] else 'NOT MET'}")


def merge(args) -> None:
    """h200.json, h200_machine.json and h200.png from the rows files of several runs."""
    rows = []
    for f in args.merge:
        try:
            rows += json.loads(Path(f).read_text())
        except (OSError, ValueError) as exc:
            print(f"merge: skipping {f}: {exc}")
    props = torch.cuda.get_device_properties(torch.device("cuda"))
    args.rows = None
    write(rows, props, args)
    for g in goals(rows):
        print(f"goal: {g['goal']:<58} {g['value']:>8} {'met' if g['met'] else 'NOT MET'}")


def write(rows, props, args):
    if args.rows:
        Path(args.rows).write_text(json.dumps(rows, indent=1))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"device": props.name, "torch": torch.__version__, "date": time.ctime(),
            "backends": fh.available_backends(), "reps": args.reps, "goals": goals(rows)}
    (out / "h200.json").write_text(json.dumps(rows, indent=1))
    (out / "h200_machine.json").write_text(json.dumps(info, indent=1))
    plot(rows, out / "h200.png", f"fasthealth on {props.name}, torch {torch.__version__}")


def goals(rows: list[dict]) -> list[dict]:
    """The GPU goals, read off the rows: share of the read limit on the largest case, speedup
    over the naive loop on GPT-2 small bf16, and speed against torch._foreach_norm alone."""
    ms = {(r["case"], r["dtype"], r["provider"]): r["ms"] for r in rows}
    out = []
    limits = [(r["ms"], r["case"], r["dtype"]) for r in rows if r["provider"] == "read_limit"]
    if not limits:
        return out
    largest = max(limits)[1:]
    for b in ("cuda", "triton"):
        if (*largest, b) not in ms:
            continue
        share = ms[(*largest, "read_limit")] / ms[(*largest, b)]
        out.append({"goal": f"{b}: share of read bandwidth, {' '.join(largest)}",
                    "value": round(share, 3), "met": share >= 0.85})
        if ("gpt2-small", "bfloat16", b) in ms and ("gpt2-small", "bfloat16", "naive") in ms:
            x = ms[("gpt2-small", "bfloat16", "naive")] / ms[("gpt2-small", "bfloat16", b)]
            out.append({"goal": f"{b}: times faster than naive, gpt2-small bfloat16",
                        "value": round(x, 1), "met": x >= 50})
        slower = [f"{c} {d}" for (c, d, p) in ms if p == b and ms[(c, d, b)] >= ms[(c, d,
                  "foreach")]]
        out.append({"goal": f"{b}: faster than _foreach_norm in every case",
                    "value": len(slower), "met": not slower, "slower_in": slower})
    return out


if __name__ == "__main__":
    main()
