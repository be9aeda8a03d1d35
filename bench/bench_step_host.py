"""Host time of ``mon.step`` and of a flushing step, this checkout against another one.

A small MLP (8 layers of 32x32, batch 16, SGD, one intra-op thread) keeps the model's own work
small, so that the Monitor's host work (its Python, its small tensor ops) is most of what is
timed; ``mon.step`` includes the optimizer's step. Each round runs the loop in a fresh process
under each checkout in turn (``PYTHONPATH``), so the machine's noise falls on both alike; the
figures are the medians over rounds of each round's median, and the median of the paired
differences.

    python bench/bench_step_host.py --against ../fasthealth-old          # 6 rounds, ~2 min
    python bench/bench_step_host.py --against ../fasthealth-old --record  # bench/results/

``--against`` is another checkout whose extension is built in place (``make build`` there, or
``fasthealth/_C*.so`` copied in from a build of the same sources).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(steps: int) -> dict:
    """The loop, in this process: medians of mon.step (ms), non-flushing and flushing."""
    import torch

    import fasthealth as fh

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    mon = fh.Monitor(m, opt)
    x = torch.randn(16, 32)
    step_ms: list[float] = []
    flush_ms: list[float] = []
    for i in range(steps):
        loss = m(x).pow(2).mean()
        loss.backward()
        flushing = (i + 1) % mon.flush_every == 0  # the record of flush_every steps is full
        t0 = time.perf_counter()
        mon.step(loss)
        (flush_ms if flushing else step_ms).append((time.perf_counter() - t0) * 1e3)
        opt.zero_grad(set_to_none=True)
    mon.close()
    return {"package": fh.__file__, "step_ms": statistics.median(step_ms[50:]),
            "flush_ms": statistics.median(flush_ms[1:])}


def run_in(tree: Path, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--worker", str(steps)], env=env,
                         capture_output=True, text=True, check=True, cwd=tree)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["package"].startswith(str(tree.resolve())):
        raise SystemExit(f"the loop under {tree} imported {r['package']}: is its extension "
                         "built in place?")
    return r


def commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    return out.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, help="another checkout, built in place")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--record", action="store_true", help="write bench/results/step_host.json")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    if args.against is None:
        ap.error("--against: the checkout to compare with")
    trees = {"this": ROOT, "against": args.against.resolve()}
    rounds: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for k, tree in trees.items():
            rounds[k].append(run_in(tree, args.steps))
        print(f"round {r + 1}/{args.rounds}: step ms this {rounds['this'][-1]['step_ms']:.4f} "
              f"against {rounds['against'][-1]['step_ms']:.4f}", flush=True)
    out: dict = {"date": time.strftime("%Y-%m-%d"),
                 "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                             "processor": platform.processor() or platform.machine()},
                 "method": __doc__.split("\n\n")[1].replace("\n", " "),
                 "steps": args.steps, "rounds": args.rounds}
    for what in ("step_ms", "flush_ms"):
        this = [x[what] for x in rounds["this"]]
        other = [x[what] for x in rounds["against"]]
        out[what] = {"this": statistics.median(this), "against": statistics.median(other),
                     "paired_difference": statistics.median(a - b for a, b in zip(this, other)),
                     "rounds_this": this, "rounds_against": other}
        print(f"{what}: this {out[what]['this']:.4f}, against {out[what]['against']:.4f}, "
              f"paired difference {out[what]['paired_difference']:+.4f}")
    out["commits"] = {k: commit(t) for k, t in trees.items()}
    if args.record:
        path = HERE / "results" / "step_host.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"written: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
