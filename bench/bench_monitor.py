"""Overhead of fh.Monitor on a GPT-2-small-sized CPU training step.

The same model, optimizer and data; steps alternate between the plain loop (backward,
optimizer.step) and the monitored loop (backward, mon.step, which also steps the optimizer),
so machine noise hits both alike. Reports the median step time of each and the overhead.
Writes bench/results/monitor_overhead.json.

    python bench/bench_monitor.py [--steps 8] [--seq 128] [--batch 1]
    python bench/bench_monitor.py --act   # also: precursors off, and skip + every precursor

With ``--act`` three Monitors take turns with the plain loop: ``precursors=False`` (no
precursor), the defaults (the update-to-weight ratio every 10 steps, the Adam-eps rule) and
``on_spike="skip"`` with the LM head's logits and every attention module watched; written to
bench/results/monitor_overhead_act.json.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fasthealth as fh
from fasthealth.demo import TinyGPT, gpt2_config


def loop(model, opt, ids):
    """(forward_backward() -> loss, plain(): the unmonitored step: clip, optimizer.step())."""
    def forward_backward():
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss

    def plain():
        forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return forward_backward, plain


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each kind")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a small model, for a smoke run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--act", action="store_true",
                    help="compare precursors off / defaults / skip + every precursor")
    args = ap.parse_args(argv)
    if args.act:
        return act(args)
    args.out = args.out or "bench/results/monitor_overhead.json"
    torch.manual_seed(0)
    cfg = gpt2_config(args.small)
    model = TinyGPT(**cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    mon = fh.Monitor(model, opt, flush_every=5, max_grad_norm=1.0)
    ids = torch.randint(0, cfg["vocab"], (args.batch, args.seq + 1))

    forward_backward, plain = loop(model, opt, ids)

    def monitored():
        loss = forward_backward()
        mon.step(loss)

    times = {"plain": [], "monitored": []}
    mon_only = []
    for fn in (plain, monitored):  # warm-up
        fn()
    for i in range(args.steps):
        for name, fn in (("plain", plain), ("monitored", monitored))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        # mon.step alone, on the gradients of a fresh backward
        loss = forward_backward()
        t0 = time.perf_counter()
        mon.step(loss)
        mon_only.append(time.perf_counter() - t0)
        print(f"\rstep pair {i + 1}/{args.steps}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    mon.close()
    plain_ms = statistics.median(times["plain"]) * 1e3
    mon_ms = statistics.median(times["monitored"]) * 1e3
    # mon.step replaces clip + optimizer.step: its own cost is what it adds beyond them
    t_opt = []
    for _ in range(3):
        forward_backward()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_opt.append(time.perf_counter() - t0)
    opt_ms = statistics.median(t_opt) * 1e3
    step_ms = statistics.median(mon_only) * 1e3
    result = {
        "model": cfg, "params": n_params, "batch": args.batch, "seq": args.seq,
        "steps_each": args.steps,
        "plain_step_ms": round(plain_ms, 2), "monitored_step_ms": round(mon_ms, 2),
        "overhead_pct_of_step": round((mon_ms - plain_ms) / plain_ms * 100, 2),
        "mon_step_ms": round(step_ms, 2), "clip_plus_optimizer_ms": round(opt_ms, 2),
        "mon_step_extra_ms": round(step_ms - opt_ms, 2),
        "extra_pct_of_step": round((step_ms - opt_ms) / plain_ms * 100, 2),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


ACT_VARIANTS = {
    "precursors_off": {"precursors": False},
    "defaults": {},
    "skip_and_every_precursor": {"on_spike": "skip", "logits": "head", "attention": r"attn$"},
}


def act(args) -> int:
    """Interleaved steps: the plain loop and one Monitor per ACT_VARIANTS entry."""
    torch.manual_seed(0)
    cfg = gpt2_config(args.small)
    model = TinyGPT(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg["vocab"], (args.batch, args.seq + 1))
    mons = {k: fh.Monitor(model, opt, flush_every=5, max_grad_norm=1.0, **v)
            for k, v in ACT_VARIANTS.items()}

    forward_backward, plain = loop(model, opt, ids)

    runs = {"plain": plain, **{k: (lambda m=m: m.step(forward_backward()))
                               for k, m in mons.items()}}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        fn()
    names = list(runs)
    for i in range(args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
        print(f"\rround {i + 1}/{args.steps}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for m in mons.values():
        m.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result = {
        "model": cfg, "batch": args.batch, "seq": args.seq, "steps_each": args.steps,
        "step_ms": {k: round(v, 2) for k, v in med.items()},
        "overhead_pct_of_plain_step": {k: round((v - med["plain"]) / med["plain"] * 100, 2)
                                       for k, v in med.items() if k != "plain"},
        "variants": ACT_VARIANTS,
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    out = Path(args.out or "bench/results/monitor_overhead_act.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
