"""Silent data corruption on one rank of a data-parallel job, by bit position: whether the
Monitor names the rank whose GPU flipped a bit (``sdc_suspect``, rule ``own_grads``) before
DDP averages its gradients into every replica.

    python evaluation/eval_sdc_ranks.py            # ~15 minutes on 2 cores
    python evaluation/eval_sdc_ranks.py --record   # into bench/results/sdc_ranks.json

``WORLD`` Gloo processes train the MLP of ``eval_sdc.py`` (64-128-10) on scikit-learn's
digits under DDP, AdamW clipped at 1.0, each rank its own draws of ``BATCH`` samples, with
``fh.Monitor(ddp, opt, process_group=...)`` at its defaults. At step ``AT``, on rank ``BAD``,
one bit of one float32 element is flipped: in the first layer's output (``forward``) or in
the gradient the second layer's backward hands to its input (``grad_input``: a matmul of the
backward, which the loss never sees), the element drawn at random, every bit position 0-31.
Each run is judged against its healthy twin (same seed, no flip):

- ``harmful``: the loss at the flip or one of the ``AFTER`` steps after it stood 6 noise units
  above the losses before, or was non-finite, or the final eval loss is above the twin's by
  more than the seed gap (the distance of the healthy seeds' eval losses);
- ``named``: an ``sdc_suspect`` event at the flip's step naming rank ``BAD``, or, where the
  flip made that rank's gradients non-finite, the ``nonfinite_grad`` event saying they were
  made on rank ``BAD``; ``misnamed``: an ``sdc_suspect`` naming another rank or another step.

Reported by site and bit: flips, harmful, harmful named, benign named; and the healthy runs'
``sdc_suspect`` events (every one false) and the largest ratio they measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import eval_sdc  # noqa: E402  (the digits and the one-process set-up)

import fasthealth as fh  # noqa: E402
from fasthealth import faults  # noqa: E402
from fasthealth.monitor.robust import spike_scores  # noqa: E402

WORLD, BAD, STEPS, AT, AFTER, BATCH = 4, 2, 300, 200, 10, 16
SITES = ("forward", "grad_input")


def _rank(rank: int, seed: int, site: str | None, bit: int | None, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        x, y = eval_sdc.digits()
        xt, yt, xe, ye = x[:1500], y[:1500], x[1500:], y[1500:]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        flip = None
        if site is not None and bit is not None and rank == BAD:
            where = model[0] if site == "forward" else model[2]
            flip = faults.BitFlip(where, at=AT, bit=bit, where=site, seed=1000 * seed + bit)
        g = torch.Generator().manual_seed(100 * seed + rank)
        losses: list[float] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mon = fh.Monitor(ddp, opt, process_group=dist.group.WORLD, max_grad_norm=1.0)
            for _ in range(STEPS):
                i = torch.randint(0, len(xt), (BATCH,), generator=g)
                loss = F.cross_entropy(ddp(xt[i]), yt[i])
                opt.zero_grad()
                loss.backward()
                mon.step(loss)
                losses.append(float(loss.detach()))
            mon.close()
        flat = torch.tensor(losses)
        dist.all_reduce(flat)  # the ranks' mean loss, the one the run's curve shows
        if rank == 0:
            model.eval()
            with torch.no_grad():
                end = float(F.cross_entropy(model(xe), ye))
            sdc = [(e.step, e.severity, e.details["rank"], e.details["ratio"])
                   for e in mon.events if e.kind == "sdc_suspect"]
            origin = [(e.step, e.details.get("origin_rank")) for e in mon.events
                      if e.kind == "nonfinite_grad"]
            Path(out).write_text(json.dumps({
                "losses": (flat / WORLD).tolist(), "end": end if math.isfinite(end) else None,
                "sdc": sdc, "origin": origin,
                "alarms": [(i.start, i.trigger, i.cause) for i in mon.incidents
                           if i.severity == "alarm"]}))
        if flip is not None:
            Path(out + ".flip").write_text(json.dumps(flip.flipped))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(seed: int, site: str | None, bit: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="fh-sdc-") as d:
        init, out = os.path.join(d, "init"), os.path.join(d, "out.json")
        mp.spawn(_rank, args=(seed, site, bit, init, out), nprocs=WORLD, join=True)
        r = json.loads(Path(out).read_text())
        flip = Path(out + ".flip")
        flipped = json.loads(flip.read_text()) if flip.exists() else None
    losses = r.pop("losses")
    before = losses[AT - 128:AT]
    hit = [min(spike_scores(before, v)) if math.isfinite(v) else math.inf
           for v in losses[AT:AT + AFTER + 1]]
    end = r["end"] if r["end"] is not None else math.inf
    return {"seed": seed, "site": site, "bit": bit, "flipped": flipped,
            "effect_z": min(max(hit), 1e9), "end": end, **r}


def judge(runs: list[dict]) -> dict:
    healthy = {r["seed"]: r for r in runs if r["site"] is None}
    ends = [r["end"] for r in healthy.values()]
    gap = max(ends) - min(ends) if len(ends) > 1 else 0.0
    table: dict[str, dict] = {}
    for r in runs:
        if r["site"] is None:
            continue
        twin = healthy[r["seed"]]["end"]
        r["harmful"] = r["effect_z"] >= 6 or not r["end"] - twin <= gap
        r["named"] = any(s == AT and rank == BAD for s, _, rank, _ in r["sdc"]) or any(
            s == AT and rank == BAD for s, rank in r["origin"])
        r["misnamed"] = any(s != AT or rank != BAD for s, _, rank, _ in r["sdc"])
        row = table.setdefault(f"{r['site']} bit {r['bit']:02d}", {
            "flips": 0, "harmful": 0, "harmful_named": 0, "benign_named": 0, "misnamed": 0})
        row["flips"] += 1
        row["harmful"] += r["harmful"]
        row["harmful_named"] += r["harmful"] and r["named"]
        row["benign_named"] += not r["harmful"] and r["named"]
        row["misnamed"] += r["misnamed"]
    totals = {k: sum(v[k] for v in table.values())
              for k in ("flips", "harmful", "harmful_named", "benign_named", "misnamed")}
    totals["healthy_runs"] = len(healthy)
    totals["healthy_sdc_events"] = sum(len(r["sdc"]) for r in healthy.values())
    return {"seed_gap": gap, "by_bit": dict(sorted(table.items())), "totals": totals}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="healthy twins (the seed gap)")
    ap.add_argument("--flip-seeds", type=int, default=1, help="seeds with flips")
    ap.add_argument("--bits", default="0-31", help="bit positions, e.g. 0-31 or 23,30")
    ap.add_argument("--record", action="store_true", help="into bench/results/sdc_ranks.json")
    a = ap.parse_args(argv)
    lo, _, hi = a.bits.partition("-")
    bits = list(range(int(lo), int(hi) + 1)) if hi else [int(b) for b in a.bits.split(",")]
    t0 = time.time()
    plan = [(s, None, None) for s in range(a.seeds)]
    plan += [(s, site, b) for s in range(a.flip_seeds) for site in SITES for b in bits]
    runs = []
    for k, args in enumerate(plan):
        runs.append(run(*args))
        r = runs[-1]
        print(f"[{k + 1}/{len(plan)}] seed {r['seed']} {r['site']} bit {r['bit']}: "
              f"z {r['effect_z']:.3g} end {r['end']:.4g} sdc {r['sdc']}", flush=True)
    eval_sdc.report(judge(runs), runs, RESULTS / "sdc_ranks.json" if a.record else None,
                    __doc__, t0, world=WORLD, bad_rank=BAD, steps=STEPS, at=AT, after=AFTER,
                    batch_per_rank=BATCH)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
