"""Overhead of fh.ActivationMonitor (every leaf module, forward and backward hooks) on a
GPT-2-small-sized CPU forward and backward, with every=1 and every=50.

Runs interleave the three variants (plain, every=1, every=50) on the same model and batch, so
machine noise hits all alike; medians are reported. Hooks are added and removed around each
timed run. Writes bench/results/activation_overhead.json.

    python bench/bench_activations.py [--runs 8] [--seq 128]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fasthealth as fh
from fasthealth.demo import TinyGPT, gpt2_config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="a small model, for a smoke run")
    ap.add_argument("--out", default="bench/results/activation_overhead.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = gpt2_config(args.small)
    model = TinyGPT(**cfg)
    ids = torch.randint(0, cfg["vocab"], (1, args.seq + 1))

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()

    monitors = {"every=1": fh.ActivationMonitor(model, every=1),
                "every=50": fh.ActivationMonitor(model, every=50)}
    n_modules = len(monitors["every=1"].names)
    for am in monitors.values():
        am.remove()
    times = {"plain": [], "every=1": [], "every=50": []}
    fwd_bwd()
    for r in range(args.runs):
        order = list(times)
        order = order[r % 3:] + order[: r % 3]
        for name in order:
            am = None
            if name != "plain":
                am = fh.ActivationMonitor(model, every=int(name.split("=")[1]))
                am._calls = r  # every=50 records on one run in 50: keep its phase realistic
            t0 = time.perf_counter()
            fwd_bwd()
            times[name].append(time.perf_counter() - t0)
            if am is not None:
                am.remove()
        print(f"\rround {r + 1}/{args.runs}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result = {
        "model": cfg, "seq": args.seq, "runs_each": args.runs, "hooked_modules": n_modules,
        "forward_backward_ms": {k: round(v, 2) for k, v in med.items()},
        "overhead_pct": {k: round((med[k] - med["plain"]) / med["plain"] * 100, 2)
                         for k in ("every=1", "every=50")},
        # each round's time over the same round's plain run: steadier on a noisy machine
        "overhead_pct_paired_median": {
            k: round((statistics.median(a / b for a, b in zip(times[k], times["plain"])) - 1)
                     * 100, 2) for k in ("every=1", "every=50")},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
