"""What the distributed path costs one rank as the world grows: ``check_grads(process_group=)``
and a Monitor step under a simulated world of 8 to 131,072 ranks.

Each world size runs in a fresh process that joins torch's fake process group (``"fake"``
backend: every collective returns at once, so what is timed is this rank's own work, which is
what grows with the world when a method gathers from every rank). The collectives' results are
simulated as a world of identical replicas would give them (DDP after its all-reduce): an
all-gather returns this rank's tensor from every rank, so that the replica sets the first call
finds are those of DDP (one set of all ranks); an all-reduce leaves its input as it is, which
for a MAX over identical replicas is the answer. Reported per world size: the median time of a
call and of a Monitor step (``fh.Monitor(model, opt, process_group=WORLD)``, SGD, between
flushes, and the flush every 50 steps in the mean), the peak resident memory of the process
above that of the same run at world 1, and the bytes this rank sends into collectives per call
(the sum of the tensors it passes), and ``check_grads`` without a process group for scale.
Model: a two-layer MLP (256-256-10), batch 32, one thread.

    python bench/bench_scale.py                          # this checkout, ~1 minute
    python bench/bench_scale.py --against ../old --worlds 8 1024 2048 --timeout 120
    python bench/bench_scale.py --record                 # bench/results/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORLDS = (1, 8, 1024, 16384, 131072)


def worker(world: int, calls: int, steps: int) -> dict:
    """One world size, in this process."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fasthealth as fh

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sent = [0]

    def counted(fn, inputs):
        def wrapped(*a, **k):
            sent[0] += sum(t.numel() * t.element_size() for t in inputs(a, k)
                           if isinstance(t, torch.Tensor))
            return fn(*a, **k)
        return wrapped

    def gather(out, inp, group=None, **k):  # every rank an identical replica
        out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))

    dist.all_reduce = counted(dist.all_reduce, lambda a, k: a[:1])
    gathered = counted(gather, lambda a, k: a[1:2])
    dist.all_gather_into_tensor = gathered
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single = gathered
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    group = dist.group.WORLD
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    x, y = torch.randn(32, 256), torch.randn(32, 10)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = []  # the same call without a process group: what one process pays
    for _ in range(calls):
        t = time.perf_counter()
        fh.check_grads(model)
        local.append(time.perf_counter() - t)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fh.check_grads(model, process_group=group)  # the group's first call: its replica sets
    times = []
    sent[0] = 0
    for _ in range(calls):
        t = time.perf_counter()
        fh.check_grads(model, process_group=group)
        times.append(time.perf_counter() - t)
    per_call = sent[0] / calls
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = fh.Monitor(model, opt, process_group=group)
    step_times, flushing = [], []
    for i in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        t = time.perf_counter()
        mon.step(torch.tensor(1.0))
        (flushing if (i + 1) % mon.flush_every == 0 else step_times).append(
            time.perf_counter() - t)
    mon.close()
    dist.destroy_process_group()
    return {"world": world, "check_grads_ms": 1e3 * statistics.median(times),
            "check_grads_no_group_ms": 1e3 * statistics.median(local),
            "monitor_step_ms": 1e3 * statistics.median(step_times),
            "monitor_step_mean_ms": 1e3 * statistics.fmean(step_times + flushing),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_mb": rss0 / 1024, "bytes_sent_per_call": per_call}


def run_world(checkout: Path, world: int, calls: int, steps: int, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(world),
           "--calls", str(calls), "--steps", str(steps)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             cwd=checkout)
    except subprocess.TimeoutExpired:
        return {"world": world, "timed_out_s": timeout}
    if out.returncode != 0:
        return {"world": world, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per world size")
    ap.add_argument("--against", default=None, help="another checkout, run on the same worlds")
    ap.add_argument("--record", action="store_true", help="write bench/results/scale.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.calls, args.steps)))
        return
    worlds = sorted(set(args.worlds) | {1})
    checkouts = {"this": ROOT}
    if args.against:
        checkouts["against"] = Path(args.against).resolve()
    res: dict = {"what": "check_grads(process_group=) and a Monitor step on one rank of a "
                         "simulated world (torch's fake process group, identical replicas)",
                 "model": "MLP 256-256-10, batch 32, SGD", "calls": args.calls,
                 "steps": args.steps, "machine": f"vm {platform.machine()}, 1 thread", "date":
                 datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "runs": {}}
    for label, checkout in checkouts.items():
        rows = []
        for w in worlds:
            r = run_world(checkout, w, args.calls, args.steps, args.timeout)
            rows.append(r)
            print(label, json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                     for k, v in r.items()}), flush=True)
        base = rows[0]
        for r in rows:
            if "peak_rss_mb" in r and "peak_rss_mb" in base:
                r["rss_above_world_1_mb"] = r["peak_rss_mb"] - base["peak_rss_mb"]
                r["time_vs_world_1"] = r["check_grads_ms"] / base["check_grads_ms"]
                r["step_vs_world_1"] = r["monitor_step_ms"] / base["monitor_step_ms"]
        res["runs"][label] = rows
    out = args.out or (str(HERE / "results" / "scale.json") if args.record else None)
    if out:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
        print("written:", out)


if __name__ == "__main__":
    main()
