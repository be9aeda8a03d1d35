"""What fasthealth costs in a nanoGPT-shaped training loop on the CPU.

nanoGPT's train.py at a size that trains on a CPU (written here from its config, nothing is
fetched): a GPT of 2 layers, 64 wide, context 64, batch 8, gradient accumulation 2, AdamW
(betas 0.9/0.95, weight decay 0.1), warm-up and cosine decay, clipping at 1.0, on the
characters of a standard-library module's source. Five copies of the same run take turns,
one step each per round, so that the machine's noise hits all of them alike:

- ``plain`` and ``plain_twin``: ``clip_grad_norm_`` and ``optimizer.step()``, as train.py
  does, twice: the costs are taken against the two together, and how far the twins stand
  apart is the benchmark's noise floor (identical copies differ by a few tenths of a percent,
  each by where its memory landed);
- ``check_grads``: the same with ``fh.check_grads(model)`` before the clip (its result
  stays on the device, as in a hot loop);
- ``monitor``: ``fh.Monitor(model, opt, max_grad_norm=1.0)`` at its defaults, whose
  ``mon.step(loss)`` replaces the clip and the optimizer step (flushes every 50 steps);
- ``monitor_no_precursors``: the same with ``precursors=False``.

Each step is timed whole (forward, backward, the step, ``zero_grad``), after ``--warmup``
steps of each. Reported per copy: the median and the mean step time (the mean includes the
Monitor's flushes) and their cost against the plain twins; and for the Monitor, the time inside
``mon.step`` alone, at the steps that flush and at those that do not, against the clip and
optimizer step it replaces. Where the Monitor's time goes: each rule's host time per flush
(its ``observe`` timed in the default Monitor's copy); the precursors' share (the LM-head
hook among them) is the difference of the two Monitor copies. ``--profile`` adds a
cProfile of ``mon.step`` over the default Monitor's steps.

    python bench/bench_loop_cost.py                      # 400 rounds, ~3 minutes on 2 cores
    python bench/bench_loop_cost.py --record             # into bench/results/loop_cost.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import platform
import pstats
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import fasthealth as fh

CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
D, HEADS, LAYERS, CTX, MICRO, ACCUM, LR, WARM = 64, 4, 2, 64, 8, 2, 1e-3, 50
ARMS = ("plain", "plain_twin", "check_grads", "monitor", "monitor_no_precursors")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                       torch.nn.Linear(4 * D, D))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in
                   self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(len(CHARS) + 1, D)
        self.wpe = torch.nn.Parameter(torch.randn(CTX, D) * 0.02)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(D)
        self.lm_head = torch.nn.Linear(D, len(CHARS) + 1)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def text_ids() -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(CHARS)}
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    return torch.tensor([index.get(ch, len(CHARS)) for ch in text])


class Run:
    """One copy of the run: the same seed, so the four copies train alike."""

    def __init__(self, arm: str, data: torch.Tensor, steps: int):
        torch.manual_seed(0)
        self.arm, self.data, self.steps = arm, data, steps
        self.g = torch.Generator().manual_seed(0)
        self.model = GPT()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.95),
                                     weight_decay=0.1)
        self.mon = None
        if arm.startswith("monitor"):
            self.mon = fh.Monitor(self.model, self.opt, max_grad_norm=1.0,
                                  precursors=arm == "monitor")
        self.rule_s: dict[str, float] = {}
        if arm == "monitor":  # each rule's host time, summed over the run
            for rule in self.mon.analyser.rules:
                rule.observe = self._timed(rule.observe, type(rule).__name__)
        self.step_s: list[float] = []  # whole steps
        self.inner_s: list[float] = []  # mon.step, or clip + optimizer.step
        self.flushed: list[bool] = []
        self.n = 0

    def _timed(self, observe, name: str):
        def timed(s):
            t = time.perf_counter()
            out = observe(s)
            self.rule_s[name] = self.rule_s.get(name, 0.0) + time.perf_counter() - t
            return out
        return timed

    def step(self, profile: cProfile.Profile | None = None) -> None:
        t0 = time.perf_counter()
        n = self.n
        lr = LR * (n + 1) / WARM if n < WARM else LR / 10 + 0.45 * LR * (
            1 + math.cos(math.pi * (n - WARM) / max(1, self.steps - WARM)))
        for group in self.opt.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros(())
        for _ in range(ACCUM):
            ix = torch.randint(len(self.data) - CTX - 1, (MICRO,), generator=self.g)
            x = torch.stack([self.data[i:i + CTX] for i in ix])
            y = torch.stack([self.data[i + 1:i + 1 + CTX] for i in ix])
            loss = self.model(x, y) / ACCUM
            loss.backward()
            step_loss += loss.detach()
        t1 = time.perf_counter()
        flushed = False
        if self.mon is not None:
            if profile is not None:
                profile.enable()
            self.mon.step(step_loss)
            if profile is not None:
                profile.disable()
            # the Monitor flushes when its record of flush_every steps is full
            flushed = (n + 1) % self.mon.flush_every == 0
        else:
            if self.arm == "check_grads":
                fh.check_grads(self.model)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        t2 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.step_s.append(t3 - t0)
        self.inner_s.append(t2 - t1)
        self.flushed.append(flushed)
        self.n += 1


def summarize(runs: dict[str, Run], warmup: int) -> dict:
    out: dict = {}
    twins = [runs["plain"].step_s[warmup:], runs["plain_twin"].step_s[warmup:]]
    pooled = twins[0] + twins[1]
    b_steps = [(a + b) / 2 for a, b in zip(*twins)]  # each round's plain step
    for arm, r in runs.items():
        steps = r.step_s[warmup:]
        inner = r.inner_s[warmup:]
        flushed = r.flushed[warmup:]
        paired = [a / b - 1 for a, b in zip(steps, b_steps)]
        row = {"median_step_ms": 1e3 * statistics.median(steps),
               "mean_step_ms": 1e3 * statistics.fmean(steps),
               "median_cost": statistics.median(steps) / statistics.median(pooled) - 1,
               "mean_cost": statistics.fmean(steps) / statistics.fmean(pooled) - 1,
               "paired_median_cost": statistics.median(paired),
               "median_inner_ms": 1e3 * statistics.median(inner),
               "mean_inner_ms": 1e3 * statistics.fmean(inner)}
        if r.mon is not None:
            at_flush = [t for t, f in zip(inner, flushed) if f]
            between = [t for t, f in zip(inner, flushed) if not f]
            row["flushes"] = len(at_flush)
            row["median_inner_at_flush_ms"] = 1e3 * statistics.median(at_flush) \
                if at_flush else None
            row["median_inner_between_ms"] = 1e3 * statistics.median(between)
        out[arm] = row
    return out


def profile_text(prof: cProfile.Profile, top: int = 25) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return "\n".join(lines[:top + 10])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=400, help="steps of each copy")
    ap.add_argument("--warmup", type=int, default=50, help="first steps left out of the figures")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--profile", action="store_true", help="where mon.step's time goes")
    ap.add_argument("--record", action="store_true", help="write bench/results/loop_cost.json")
    ap.add_argument("--out", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.rounds <= args.warmup:
        ap.error(f"--rounds ({args.rounds}) must exceed --warmup ({args.warmup})")
    torch.set_num_threads(args.threads)
    data = text_ids()
    runs = {arm: Run(arm, data, args.rounds) for arm in ARMS}
    prof = cProfile.Profile() if args.profile else None
    show = sys.stderr.isatty()
    t0 = time.perf_counter()
    for i in range(args.rounds):
        order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]  # who goes first rotates
        for arm in order:
            runs[arm].step(prof if arm == "monitor" and i >= args.warmup else None)
        if show and (i % 10 == 9 or i == args.rounds - 1):
            print(f"\rround {i + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)",
                  end="", file=sys.stderr, flush=True)
    if show:
        print(file=sys.stderr)
    for r in runs.values():
        if r.mon is not None:
            r.mon.close()
    mon = runs["monitor"]
    flushes = max(1, mon.n // mon.mon.flush_every)
    res = {"what": "nanoGPT-shaped loop (2 layers, 64 wide, context 64, batch 8 x 2 "
                   "accumulated, AdamW, clip 1.0), five copies taking turns a step each",
           "rounds": args.rounds, "warmup": args.warmup, "threads": args.threads,
           "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                      f"{torch.get_num_threads()} thread(s), torch {torch.__version__}",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "seconds": round(time.perf_counter() - t0, 1),
           "arms": summarize(runs, args.warmup),
           "rule_ms_per_flush": {k: round(1e3 * v / flushes, 3) for k, v in
                                 sorted(mon.rule_s.items(), key=lambda kv: -kv[1])}}
    if prof is not None:
        res["profile"] = profile_text(prof)
    print(f"{'copy':<24} {'median ms':>10} {'mean ms':>9} {'median +':>9} {'mean +':>8} "
          f"{'paired +':>9} {'inner med':>10}")
    for arm, row in res["arms"].items():
        print(f"{arm:<24} {row['median_step_ms']:>10.2f} {row['mean_step_ms']:>9.2f} "
              f"{row['median_cost']:>+9.2%} {row['mean_cost']:>+8.2%} "
              f"{row['paired_median_cost']:>+9.2%} {row['median_inner_ms']:>10.3f}")
    for arm in ("monitor", "monitor_no_precursors"):
        row = res["arms"][arm]
        print(f"{arm}: mon.step {row['median_inner_between_ms']:.3f} ms between flushes, "
              f"{row['median_inner_at_flush_ms']:.3f} ms at its {row['flushes']} flushes")
    rules = res["rule_ms_per_flush"]
    print(f"rules, host ms per flush of {mon.mon.flush_every} steps: {sum(rules.values()):.2f} "
          f"(" + ", ".join(f"{k} {v:.2f}" for k, v in list(rules.items())[:6]) + ", ...)")
    if prof is not None:
        print(res["profile"])
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / "loop_cost.json" if args.record else
        Path(__file__).parents[1] / "build" / "bench-results" / "loop_cost.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
