"""Silent data corruption in one process, by bit position: what today's detectors see of a
flipped bit in a matmul's output (``fasthealth.faults.BitFlip``), the baseline a detector for
silent data corruption must beat.

    python evaluation/eval_sdc.py                # ~5 minutes on a CPU core
    python evaluation/eval_sdc.py --record       # into bench/results/sdc.json

Plain loops on scikit-learn's digits under ``fh.Monitor`` at its defaults, an MLP (64-128-10)
in two set-ups: AdamW clipped at 1.0 (``adamw_clip``: as large models train) and SGD with
momentum, unclipped (``sgd``); batch 32, ``STEPS`` steps. At step ``AT`` one bit of one float32
element is flipped in the first layer's matmul output: its forward output (``forward``) or its
weight's gradient (``grad_weight``), an element drawn at random per run, every bit position
0-31, a few seeds. Each run is judged against its healthy twin (same set-up and seed, no flip):

- ``visible``: the loss at the flip's step or one of the ``AFTER`` steps after it stood 6 noise
  units or more above the losses before (the detector's own score), or was non-finite;
- ``harmful``: visible, or the final eval loss (held-out samples) above the twin's by more than
  the seed gap (the largest distance of two healthy seeds' eval losses), or non-finite;
- ``caught``: an alarm incident opened within ``AFTER`` steps of the flip.

Reported by bit position: flips, harmful, harmful caught, benign with an alarm (a false alarm
on a flip that did no harm), and the healthy runs' alarms.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"
sys.path.insert(0, str(HERE.parent))

import fasthealth as fh  # noqa: E402
from fasthealth import faults  # noqa: E402
from fasthealth.monitor.robust import spike_scores  # noqa: E402

STEPS, AT, AFTER, BATCH = 300, 200, 10, 32
SITES = ("forward", "grad_weight")


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # the corpus's data, needed only here

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)


SETUPS = ("adamw_clip", "sgd")


def build(setup: str) -> tuple[nn.Module, torch.optim.Optimizer, float | None]:
    """(model, optimizer, max_grad_norm) of a set-up."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if setup == "adamw_clip":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3), 1.0
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def run(model_name: str, seed: int, site: str | None, bit: int | None) -> dict:
    x, y = digits()
    xt, yt, xe, ye = x[:1500], y[:1500], x[1500:], y[1500:]
    torch.manual_seed(seed)
    model, opt, clip = build(model_name)
    flip = None
    if site is not None and bit is not None:
        flip = faults.BitFlip(model[0], at=AT, bit=bit, where=site, seed=1000 * seed + bit)
    g = torch.Generator().manual_seed(100 + seed)
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = fh.Monitor(model, opt, max_grad_norm=clip)
        for _ in range(STEPS):
            i = torch.randint(0, len(xt), (BATCH,), generator=g)
            loss = F.cross_entropy(model(xt[i]), yt[i])
            loss.backward()
            losses.append(float(loss.detach()))
            mon.step(loss, batch=(xt[i], yt[i]))
            opt.zero_grad()
        mon.close()
    model.eval()
    with torch.no_grad():
        end = float(F.cross_entropy(model(xe), ye))
    before = losses[max(0, AT - 128):AT]
    hit = [min(spike_scores(before, v)) if math.isfinite(v) else math.inf
           for v in losses[AT:AT + AFTER + 1]]
    alarms = [i for i in mon.incidents if i.severity == "alarm"]
    return {"model": model_name, "seed": seed, "site": site, "bit": bit,
            "flipped": list(flip.flipped) if flip and flip.flipped else None,
            "effect_z": min(max(hit), 1e9), "end": end if math.isfinite(end) else math.inf,
            "alarms": [(i.start, i.trigger, i.cause) for i in alarms],
            "caught": any(AT <= i.start <= AT + AFTER for i in alarms)}


def judge(runs: list[dict]) -> dict:
    healthy = {(r["model"], r["seed"]): r for r in runs if r["site"] is None}
    gap = {}
    for m in {k[0] for k in healthy}:
        ends = [r["end"] for k, r in healthy.items() if k[0] == m]
        gap[m] = max(ends) - min(ends) if len(ends) > 1 else 0.0
    table: dict[str, dict] = {}
    for r in runs:
        if r["site"] is None:
            continue
        twin = healthy[(r["model"], r["seed"])]["end"]
        r["visible"] = r["effect_z"] >= 6
        r["harmful"] = r["visible"] or not r["end"] - twin <= gap[r["model"]]
        row = table.setdefault(f"{r['site']} bit {r['bit']:02d}",
                               {"flips": 0, "harmful": 0, "harmful_caught": 0,
                                "benign_alarmed": 0})
        row["flips"] += 1
        row["harmful"] += r["harmful"]
        row["harmful_caught"] += r["harmful"] and r["caught"]
        row["benign_alarmed"] += not r["harmful"] and bool(r["alarms"])
    totals = {k: sum(v[k] for v in table.values())
              for k in ("flips", "harmful", "harmful_caught", "benign_alarmed")}
    totals["healthy_runs"] = len(healthy)
    totals["healthy_alarms"] = sum(len(r["alarms"]) for r in healthy.values())
    return {"seed_gap": gap, "by_bit": dict(sorted(table.items())), "totals": totals}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--record", action="store_true", help="into bench/results/sdc.json")
    a = ap.parse_args(argv)
    t0 = time.time()
    plan = [(m, s, None, None) for m in a.models for s in range(a.seeds)]
    plan += [(m, s, site, b) for m in a.models for s in range(a.seeds) for site in SITES
             for b in range(32)]
    runs = []
    for k, args in enumerate(plan):
        runs.append(run(*args))
        r = runs[-1]
        print(f"[{k + 1}/{len(plan)}] {r['model']} seed {r['seed']} {r['site']} bit {r['bit']}:"
              f" z {r['effect_z']:.3g} end {r['end']:.4g} alarms {r['alarms']}", flush=True)
    report(judge(runs), runs, RESULTS / "sdc.json" if a.record else None, __doc__, t0,
           steps=STEPS, at=AT, after=AFTER, seeds=a.seeds)
    return 0


def report(res: dict, runs: list[dict], out: Path | None, doc: str | None, t0: float,
           **settings: object) -> None:
    """Prints ``res``'s totals and each bit's row; with ``out``, writes the entry there: what
    (``doc``'s first paragraph), the machine, the date, the commit, ``settings``, the seconds
    since ``t0``, the verdicts and the runs."""
    print(json.dumps(res["totals"]))
    for k, v in res["by_bit"].items():
        print(f"{k:20s} {v}")
    if out is None:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip() or None
    entry = {"what": (doc or "").split("\n\n")[0].replace("\n", " "),
             "machine": f"{platform.machine()}, torch {torch.__version__}",
             "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "commit": commit, **settings, "seconds": round(time.time() - t0), **res,
             "runs": runs}
    out.write_text(json.dumps(entry, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
