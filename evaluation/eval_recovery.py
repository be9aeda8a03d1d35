"""Recovery that holds: rolling back (``rollback=``) judged by how runs end, with faults planted
late and faults that come back.

    python evaluation/eval_recovery.py              # the tuning families, 2 seeds
    python evaluation/eval_recovery.py --final      # the held-out families too: once, at the end
    python evaluation/eval_recovery.py --only digits_mlp_adamw,recurring

Every run is a plain loop on real data (scikit-learn's digits, the characters of a
standard-library module's source), each epoch a fresh permutation of the training samples with
the quarantined ones dropped (``fh.skip_quarantined``), under
``fh.Monitor(rollback=fh.RollbackConfig(replay=...), scheduler=...)`` as the README shows; the
replay gives one loss per sample. Faults are planted at 60% of the run:

- ``recurring``: 4% of the training samples turn to garbage (inputs of noise, labels drawn at
  random) and stay so: they come back every epoch;
- ``shard``: a contiguous tenth of the samples (a corrupted shard) turns to garbage;
- ``stream``: every batch garbage from the onset on (an endless bad stream);
- ``lr_bug``: the learning rate 30x the schedule's from the onset on, set by the loop (a bug in
  the code, which a restore does not undo);
- ``weight``: one weight, the largest of the first layer, times 1e4, once.

A run is judged by its end: the eval loss (on held-out samples, clean) against its healthy
twin's (the same family and seed), in units of the seed-to-seed gap of the healthy runs (the
largest distance of two healthy seeds' eval losses); or a clean stop (``RollbackBudgetError``)
and the cause it named. Where the fault touched samples: the quarantine's precision and recall
against the samples planted. Each fault also runs without rollback: the harm a rollback undoes.
Healthy runs: rollbacks and alarms (none is right).

The split: ``TUNING`` families are what the ladder and the culprit search were chosen on; the
``HELD_OUT`` ones (a CNN, a character LM) and ``TRAINERS`` (the tuning MLP through the Hugging
Face Trainer and Lightning, ``recovery_trainers.py``) are scored with ``--final`` only.

Writes bench/results/recovery.json (or --out) under --label, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # recovery_trainers, beside this file, however it is loaded

import recovery_trainers  # noqa: E402  (this folder is on sys.path)

import fasthealth as fh  # noqa: E402

TUNING = ("digits_mlp_adamw", "digits_mlp_sgd")
HELD_OUT = ("digits_cnn_adamw", "chars_lm_adamw")
TRAINERS = recovery_trainers.FAMILIES
"""The plain loops' MLP through the Hugging Face Trainer and Lightning: held out (nothing was
chosen on them)."""
FAULTS = ("recurring", "shard", "stream", "lr_bug", "weight")
EXPECTED_STOP = {"stream": "batch", "lr_bug": "learning_rate"}
"""Faults a rollback cannot undo (they come back with the next batch): a clean stop naming
this cause is their right end."""
ONSET_SHARE = 0.6
BATCH = 32


# ---- data and models --------------------------------------------------------------------------

def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)


CTX, VOCAB = 16, 96


def chars() -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of ``CTX`` characters of argparse's source and the character after each."""
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    ids = torch.tensor([min(max(ord(c) - 32, 0), VOCAB - 1) for c in text])
    starts = torch.arange(0, len(ids) - CTX - 1, 7)[:1800]
    return torch.stack([ids[s:s + CTX] for s in starts]), ids[starts + CTX]


class CharLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(CTX * 24, 128), nn.GELU(),
                                 nn.Linear(128, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.emb(x))


def family(name: str, seed: int):
    """(model, optimizer, scheduler, steps, data (x, y), the number of training samples)."""
    torch.manual_seed(seed)
    x, y = chars() if name.startswith("chars") else digits()
    if name.startswith("digits_cnn"):
        x = x.view(-1, 1, 8, 8)
        model: nn.Module = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
    elif name.startswith("chars"):
        model = CharLM()
    else:
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    steps = 1500
    # rates at which the runs are still learning at their end, as large runs are: at 3e-3 the
    # MLP overfits digits, and 4% garbage samples lowered its eval loss (a regulariser)
    if name.endswith("sgd"):
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, nesterov=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=steps // 2, gamma=0.3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=3e-5)
    return model, opt, sched, steps, (x, y), 1500


def per_sample_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def garbage(x: torch.Tensor, y: torch.Tensor, seed: int, classes: int):
    """Garbage in the place of samples ``x``: noise for an image, random characters for text,
    and labels drawn at random."""
    g = torch.Generator().manual_seed(seed)
    if x.is_floating_point():
        bad = torch.randn(x.shape, generator=g) * 3
    else:
        bad = torch.randint(0, VOCAB, x.shape, generator=g)
    return bad, torch.randint(0, classes, y.shape, generator=g)


# ---- one run ----------------------------------------------------------------------------------

@dataclass
class Run:
    family: str
    fault: str
    seed: int
    rollback: bool
    eval_loss: float = math.nan
    stopped: str | None = None  # the cause a RollbackBudgetError named
    stop_step: int | None = None
    onset: int = 0
    rollbacks: list = field(default_factory=list)  # (step, to_step, incident cause, samples)
    alarms: int = 0
    planted: int = 0
    quarantined: int = 0
    quarantined_bad: int = 0
    quarantine_skips: int = 0  # steps skipped for a quarantined sample in their batch
    seconds: float = 0.0


def bad_samples(fault: str, n_train: int, g: torch.Generator) -> set[int]:
    """The training samples ``fault`` turns to garbage (none for the other faults)."""
    if fault == "recurring":
        return set(torch.randperm(n_train, generator=g)[:n_train // 25].tolist())
    if fault == "shard":
        start = int(torch.randint(0, n_train - n_train // 10, (1,), generator=g))
        return set(range(start, start + n_train // 10))
    return set()


def run(name: str, fault: str, seed: int, rollback: bool = True) -> Run:
    model, opt, sched, steps, (x, y), n_train = family(
        "digits_mlp_adamw" if name in TRAINERS else name, seed)
    classes = VOCAB if name.startswith("chars") else 10
    onset = int(steps * ONSET_SHARE)
    g = torch.Generator().manual_seed(1000 + seed)
    xt, yt, xe, ye = x[:n_train].clone(), y[:n_train].clone(), x[n_train:], y[n_train:]
    bad = bad_samples(fault, n_train, g)
    if bad:
        idx = torch.tensor(sorted(bad))
        gx, gy = garbage(xt[idx], yt[idx], seed, classes)
    out = Run(name, fault, seed, rollback, onset=onset, planted=len(bad))
    if name in TRAINERS:
        recovery_trainers.run_trainer(name, fault, seed, rollback, out, bad,
                                      (xt, yt, xe, ye, (gx, gy) if bad else None), garbage,
                                      steps, BATCH)
        return out
    mon = fh.Monitor(model, opt, scheduler=sched,
                     rollback=fh.RollbackConfig(replay=per_sample_loss) if rollback else None)
    t0, t, epoch = time.perf_counter(), 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            while t < steps:
                perm = torch.randperm(n_train, generator=g).tolist()
                order = list(fh.skip_quarantined(perm, mon)) if rollback else perm
                if len(order) < BATCH:  # the quarantine took the whole set
                    out.stopped, out.stop_step = "no data left", t
                    break
                for k in range(0, len(order) - BATCH + 1, BATCH):
                    if t >= steps:
                        break
                    if t == onset and bad:
                        xt[idx], yt[idx] = gx, gy
                    ids = torch.tensor(order[k:k + BATCH])
                    bx, by = xt[ids], yt[ids]
                    if fault == "stream" and t >= onset:
                        bx, by = garbage(bx, by, 10_000 * seed + t, classes)
                    if fault == "lr_bug" and t >= onset:
                        for grp in opt.param_groups:
                            grp["lr"] = sched.get_last_lr()[0] * 30
                    loss = F.cross_entropy(model(bx), by)
                    opt.zero_grad()
                    loss.backward()
                    mon.step(loss, batch=(bx, by), sample_ids=ids)
                    if fault == "lr_bug" and t >= onset:  # the schedule's own rate, restored
                        for grp, lr in zip(opt.param_groups, sched.get_last_lr()):
                            grp["lr"] = lr
                    sched.step()
                    if fault == "weight" and t == onset:
                        with torch.no_grad():
                            w = next(model.parameters()).view(-1)
                            w[w.abs().argmax()] *= 1e4
                    t += 1
                epoch += 1
            mon.close()
        except fh.RollbackBudgetError as e:
            out.stopped, out.stop_step = e.cause or "budget", t
            mon.close()
    out.seconds = time.perf_counter() - t0
    with torch.no_grad():
        model.eval()
        out.eval_loss = float(F.cross_entropy(model(xe), ye))
    recovery_trainers.outcome(out, mon, bad)
    return out


# ---- the whole ----------------------------------------------------------------------------------

def judge(runs: list[Run]) -> list[dict]:
    """One row per faulted run: its end against its twin's in seed gaps, or its stop."""
    healthy = {(r.family, r.seed): r for r in runs if r.fault == "healthy" and r.rollback}
    gaps = {}
    for fam in {r.family for r in runs}:
        levels = [r.eval_loss for (f, _), r in healthy.items() if f == fam]
        gaps[fam] = max((abs(a - b) for a in levels for b in levels), default=math.nan)
    rows = []
    for r in runs:
        twin = healthy.get((r.family, r.seed))
        gap = gaps.get(r.family, math.nan)
        delta = (r.eval_loss - twin.eval_loss) / gap if twin and gap > 0 else math.nan
        row = {**asdict(r), "gap": gap, "end_in_gaps": round(delta, 2)}
        if r.fault == "healthy":
            row["verdict"] = "ok" if not r.rollbacks and not r.alarms else "false alarm"
        elif r.stopped is not None:
            want = EXPECTED_STOP.get(r.fault)
            row["verdict"] = "stopped, right cause" if want == r.stopped else \
                f"stopped ({r.stopped})"
        else:
            row["verdict"] = "within the gap" if abs(delta) <= 1 else "outside the gap"
        alone = next((x for x in runs if (x.family, x.fault, x.seed) == (r.family, r.fault, r.seed)
                      and not x.rollback), None)
        row["left_alone_in_gaps"] = (round((alone.eval_loss - twin.eval_loss) / gap, 2)
                                     if alone and twin and gap > 0 else None)
        if r.planted:
            row["precision"] = round(r.quarantined_bad / r.quarantined, 3) if r.quarantined \
                else None
            row["recall"] = round(r.quarantined_bad / r.planted, 3)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| family | fault | seed | end (seed gaps) | left alone | verdict | rollbacks | "
             "quarantine (precision, recall) |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["family"], r["fault"], r["seed"])):
        if not r["rollback"]:
            continue
        q = "" if not r["planted"] else f"{r['quarantined']} ({r['precision']}, {r['recall']})"
        if r.get("quarantine_skips"):
            q += f"; {r['quarantine_skips']} steps skipped for them"
        alone = "" if r["left_alone_in_gaps"] is None else r["left_alone_in_gaps"]
        lines.append(f"| {r['family']} | {r['fault']} | {r['seed']} | {r['end_in_gaps']} | "
                     f"{alone} | {r['verdict']} | {len(r['rollbacks'])} | {q} |")
    return "\n".join(lines)


def runs_of(rows: list[dict]) -> list[Run]:
    """The runs a results file's rows were judged from."""
    names = set(Run.__dataclass_fields__)
    return [Run(**{k: v for k, v in r.items() if k in names}) for r in rows]


def summary(rows: list[dict]) -> str:
    """Totals per split: false alarms, faulted runs within the gap or stopped with the right
    cause, and the quarantine's precision and recall over all planted samples."""
    out = []
    for split, fams in (("tuning", TUNING), ("held out", HELD_OUT),
                        ("held out, through the trainers", TRAINERS)):
        mine = [r for r in rows if r["family"] in fams and r["rollback"]]
        if not mine:
            continue
        healthy = [r for r in mine if r["fault"] == "healthy"]
        faulted = [r for r in mine if r["fault"] != "healthy"]
        good = [r for r in faulted if r["verdict"] in ("within the gap", "stopped, right cause")]
        seeded = [r for r in faulted if r["planted"]]  # the faults with bad samples to find
        planted = sum(r["planted"] for r in seeded)
        caught = sum(r["quarantined_bad"] for r in seeded)
        held = sum(r["quarantined"] for r in seeded)
        out.append(f"{split}: healthy {len(healthy)} runs, "
                   f"{sum(r['verdict'] != 'ok' for r in healthy)} with an alarm or a rollback; "
                   f"faulted {len(good)}/{len(faulted)} within the seed gap or stopped with the "
                   f"right cause; quarantine precision {caught / held if held else 0:.3f}, "
                   f"recall {caught / planted if planted else 0:.3f}")
    return "\n".join(out)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--final", action="store_true", help="also the held-out families")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--only", help="comma-separated family and fault names")
    ap.add_argument("--label")
    ap.add_argument("--out", default=str(RESULTS / "recovery.json"))
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--table", metavar="LABEL", help="print the table of --out's entry LABEL "
                    "(judged again from its runs) and stop")
    args = ap.parse_args(argv)
    if args.table:
        entry = json.loads(Path(args.out).read_text())[args.table]
        rows = judge(runs_of(entry["runs"]))
        print(table(rows))
        print(summary(rows))
        return 0
    only = set(args.only.split(",")) if args.only else None
    every = TUNING + HELD_OUT + TRAINERS
    fams = [f for f in TUNING + (HELD_OUT + TRAINERS if args.final else ())
            if only is None or f in only or not only & set(every)]
    faults = [f for f in FAULTS if only is None or f in only or not only & set(FAULTS)]
    jobs = [(f, "healthy", s, True) for f in fams for s in range(max(args.seeds, 3))]
    jobs += [(f, fault, s, rb) for f in fams for fault in faults for s in range(args.seeds)
             for rb in (True, False)]
    t0 = time.time()
    runs: list[Run] = []
    with ProcessPoolExecutor(args.workers) as ex:
        futures = [ex.submit(run, *job) for job in jobs]
        for i, fut in enumerate(as_completed(futures), 1):
            r = fut.result()
            runs.append(r)
            print(f"[{i}/{len(jobs)}] {r.family} {r.fault} seed {r.seed} rollback {r.rollback}: "
                  f"eval {r.eval_loss:.4g}, stopped {r.stopped}, rollbacks {len(r.rollbacks)}",
                  flush=True)
    rows = judge(runs)
    print(table(rows))
    print(summary(rows))
    label = args.label or f"{time.strftime('%Y-%m-%d')} {_commit()}"
    path = Path(args.out)
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc[label] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": f"{platform.machine()}, {os.cpu_count()} thread(s), torch "
                             f"{torch.__version__}",
                  "final": args.final, "seconds": round(time.time() - t0), "runs": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
