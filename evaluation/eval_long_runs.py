"""Verdicts over long runs: the Monitor's defaults on runs 8,000-30,000 steps long
(``evaluation/detectors/long_runs.py``), healthy and with faults planted late.

    python evaluation/eval_long_runs.py            # tuning part: ~20 min on 2 cores
    python evaluation/eval_long_runs.py --final    # also the held-out part, once: ~25 min
    python evaluation/eval_long_runs.py --cache build/detector-runs   # replay recordings
    python evaluation/eval_long_runs.py --skips    # on_spike="skip" at floors: ~1 min

Scores: for each healthy long run, its alarms (every one is false) and notices, and for each
alarm how far the loss's level rose with it (``LEVEL_MOVED``: a blip, or an episode of the run's
own that shows in its curve); per part, the alarms per 10,000 healthy steps and the runs with
any; for each fault planted at 85% of an
8,000-step run, whether an alarm of one of its kinds came within its allowed delay (as in
``eval_detectors.py``), and the alarms before its onset. Families that go unstable by
themselves when run that long (``long_runs.UNSTABLE``) are run and shown, their alarms and
those of the faults planted in them before the onset not counted as false.

Writes ``bench/results/long_runs.json`` (or ``--out``) under ``--label`` and the figure
``bench/results/long_runs.png``: every healthy long run's loss (the seed with the most alarms),
alarms in red, notices in grey.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "detectors"))
sys.path.insert(0, str(HERE))

import eval_detectors  # noqa: E402  (the short corpus's verdicts, provenance and saving)

RESULTS = eval_detectors.RESULTS
LONG_STEPS = 8000  # long_runs.LONG, for the skip counts
CURVE_POINTS = 1000  # stretches of the loss curve kept per run (lowest, highest): the figure
# What an alarm on a healthy run marked: the loss's median over the EPISODE steps from it over
# its median over the BEFORE steps before it. A blip leaves the level where it was (~1x); at
# LEVEL_MOVED or more the run's own level rose with it (the loss curve shows an episode).
EPISODE, BEFORE, LEVEL_MOVED = 20, 128, 10.0


def _job(args: tuple) -> dict:
    import torch

    torch.set_num_threads(1)
    import corpus

    run, seed, cache = args
    r = corpus.run(run.kind, run.name, seed, steps=run.steps, options=[{}], cache=cache,
                   onset=run.onset)
    curve = r.pop("curve")
    r["level_rise"] = {step: _level_rise(curve, step) for step, _, severity, _ in r["events"]
                       if severity == "alarm"}
    every = max(1, len(curve) // CURVE_POINTS)
    finite = [[x for x in curve[i:i + every] if x == x and abs(x) != math.inf]
              for i in range(0, len(curve), every)]
    r["curve"] = [[min(xs), max(xs)] if xs else [math.nan, math.nan] for xs in finite]
    r["curve_every"] = every
    r["key"], r["long_held_out"] = run.key, run.held_out
    return r


def _level_rise(curve: list[float], step: int) -> float:
    """The loss's median over ``EPISODE`` steps from ``step`` over its median over the
    ``BEFORE`` steps before it (finite losses only; NaN without either)."""
    def median(xs):
        xs = sorted(x for x in xs if x == x and abs(x) != math.inf)
        return xs[len(xs) // 2] if xs else math.nan

    before, after = median(curve[max(0, step - BEFORE):step]), median(curve[step:step + EPISODE])
    return after / before if before > 0 else math.nan


def run_all(jobs: list[tuple], workers: int, progress: bool = False) -> list[dict]:
    return eval_detectors.run_all_with(_job, jobs, workers, progress, "long runs")


def jobs(final: bool, cache: Path | None, only: set[str] | None = None) -> list[tuple]:
    import long_runs

    out = []
    for run in long_runs.RUNS:
        if (run.held_out and not final) or (only and run.name not in only):
            continue
        seeds = long_runs.HEALTHY_SEEDS if run.kind == "healthy" else long_runs.FAULT_SEEDS
        if run.kind == "healthy" and run.name in long_runs.UNSTABLE:
            seeds = seeds[:1]
        out += [(run, s, cache) for s in seeds]
    cost = {run.name: run.steps * (3 if "transformer" in run.name or "lstm" in run.name
                                   or "gru" in run.name else 1) for run, _, _ in out}
    return sorted(out, key=lambda j: -cost[j[0].name])


def _healthy_rows(runs: list[dict], unstable: dict) -> dict:
    rows = {}
    for r in runs:
        v = eval_detectors.verdict(r, 0)
        row = rows.setdefault(r["key"], {"runs": 0, "steps": 0, "alarms": [], "notices": 0,
                                         "held_out": r["long_held_out"],
                                         "unstable": unstable.get(r["name"]),
                                         "loss": []})
        row["runs"] += 1
        row["steps"] += r["steps"]
        row["alarms"] += [[r["seed"], s, k] for s, k in v["alarms"]]
        row.setdefault("level_rise", []).extend(
            [r["seed"], s, round(r["level_rise"].get(s, math.nan), 2)] for s, _ in v["alarms"])
        row["notices"] += len(v["notices"])
        row["loss"].append([r["loss_first"], r["loss_last"]])
    return dict(sorted(rows.items()))


def _fault_rows(runs: list[dict], unstable: dict) -> dict:
    rows = {}
    for r in runs:
        v = eval_detectors.verdict(r, 0)
        row = rows.setdefault(r["name"], {"in": r["group"], "held_out": r["long_held_out"],
                                          "expect": r["expect"], "max_delay": r["max_delay"],
                                          "unstable_family": r["group"] in unstable,
                                          "runs": []})
        row["runs"].append({"seed": r["seed"], "onset": r["onset"], "caught": v["caught"],
                            "delay": v["delay"], "alarms_before": len(v["alarms"]),
                            "kinds": v["kinds"]})
    for row in rows.values():
        row["caught"] = sum(x["caught"] for x in row["runs"])
    return dict(sorted(rows.items()))


def _totals(healthy: dict, faults: dict, held_out: bool) -> dict:
    fam = [r for r in healthy.values() if r["held_out"] == held_out and not r["unstable"]]
    flt = [r for r in faults.values() if r["held_out"] == held_out]
    steps = sum(r["steps"] for r in fam)
    alarms = sum(len(r["alarms"]) for r in fam)
    return {"healthy_runs": sum(r["runs"] for r in fam), "healthy_steps": steps,
            "alarms": alarms, "alarms_per_10k": eval_detectors.per_10k(alarms, steps),
            "runs_with_alarms": sum(len({a[0] for a in r["alarms"]}) for r in fam),
            "alarms_with_level_moved": sum(x[2] >= LEVEL_MOVED for r in fam
                                           for x in r.get("level_rise", [])),
            "notices_per_10k": eval_detectors.per_10k(sum(r["notices"] for r in fam), steps),
            "fault_runs": sum(len(r["runs"]) for r in flt),
            "fault_runs_caught": sum(r["caught"] for r in flt),
            "false_alarms_before_onsets": sum(x["alarms_before"] for r in flt
                                              if not r["unstable_family"] for x in r["runs"])}


def evaluate(final: bool, workers: int, cache: Path | None, only: set[str] | None = None,
             progress: bool = True) -> tuple[dict, list[dict]]:
    import long_runs

    t0 = time.time()
    runs = run_all(jobs(final, cache, only), workers, progress)
    healthy = _healthy_rows([r for r in runs if r["kind"] == "healthy"], long_runs.UNSTABLE)
    faults = _fault_rows([r for r in runs if r["kind"] == "fault"], long_runs.UNSTABLE)
    res = {"steps": {"long": long_runs.LONG, "longest": long_runs.LONGEST,
                     "late": long_runs.LATE},
           "seeds": {"healthy": list(long_runs.HEALTHY_SEEDS),
                     "faults": list(long_runs.FAULT_SEEDS)},
           "tuning": _totals(healthy, faults, False),
           "healthy": healthy, "faults": faults,
           "runs": len(runs), "cached_runs": sum(r["cached"] for r in runs),
           "train_seconds": round(sum(r["train_seconds"] for r in runs), 1)}
    if final:
        res["held_out"] = _totals(healthy, faults, True)
    res["wall_seconds"] = round(time.time() - t0, 1)
    return res, runs


def table(res: dict) -> str:
    lines = [f"{'healthy long run':<52}{'runs':>5} {'steps':>7} {'alarms':>7} {'notices':>8}"
             "  alarms (seed, step, kind)"]
    for key, row in res["healthy"].items():
        mark = " (held out)" if row["held_out"] else ""
        mark += " UNSTABLE, not counted" if row["unstable"] else ""
        rise = {(s, t): x for s, t, x in row.get("level_rise", [])}
        shown = ", ".join(f"{s}/{t} {k} (level x{rise.get((s, t), math.nan):.3g})"
                          for s, t, k in row["alarms"][:4])
        more = f" +{len(row['alarms']) - 4}" if len(row["alarms"]) > 4 else ""
        lines.append(f"{key + mark:<52}{row['runs']:>5} {row['steps']:>7} "
                     f"{len(row['alarms']):>7} {row['notices']:>8}  {shown}{more}")
    lines += ["", f"{'fault, planted at 85% of 8000 steps':<44}{'caught':>7} {'delays':>12} "
                  f"{'allowed':>8} {'alarms before':>14}"]
    for name, row in res["faults"].items():
        mark = " (held out)" if row["held_out"] else ""
        delays = ",".join("-" if x["delay"] is None else str(x["delay"]) for x in row["runs"])
        before = ",".join(str(x["alarms_before"]) for x in row["runs"])
        unstable = "  (its family unstable that long)" if row["unstable_family"] else ""
        lines.append(f"{name + mark:<44}{row['caught']:>3}/{len(row['runs']):<3} {delays:>12} "
                     f"{row['max_delay']:>8} {before:>14}{unstable}")
    for part in ("tuning", "held_out"):
        if part in res:
            t = res[part]
            lines.append(f"{part}: {t['alarms']} alarms in {t['healthy_steps']} healthy steps "
                         f"({t['alarms_per_10k']}/10k, {t['runs_with_alarms']} of "
                         f"{t['healthy_runs']} runs; {t['alarms_with_level_moved']} where the "
                         f"loss's level rose {LEVEL_MOVED:g}x with it), faults caught "
                         f"{t['fault_runs_caught']}/"
                         f"{t['fault_runs']}, {t['false_alarms_before_onsets']} alarms before "
                         "their onsets")
    return "\n".join(lines)


def figure(runs: list[dict], path: Path) -> None:
    """Every healthy long run's loss (log scale; over each stretch of steps its lowest, a line,
    and its range, shaded), alarms as red lines, notices as grey ticks at the bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def alarms(r):
        return sum(sev == "alarm" for _, _, sev, _ in r["events"])

    best: dict[str, dict] = {}  # per run: the seed with the most alarms, else the first
    for r in sorted((r for r in runs if r["kind"] == "healthy"), key=lambda r: r["seed"]):
        if r["key"] not in best or alarms(r) > alarms(best[r["key"]]):
            best[r["key"]] = r
    shown = sorted(best.values(), key=lambda r: (r["long_held_out"], r["key"]))
    if not shown:  # faults alone (--only): no healthy run to draw
        print("no healthy long run: no figure")
        return
    cols = 5
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.1 * rows), squeeze=False)
    for ax, r in zip(axes.flat, shown):
        xs = [i * r["curve_every"] for i in range(len(r["curve"]))]
        lo = [y if y > 0 else math.nan for y, _ in r["curve"]]
        hi = [y if y > 0 else math.nan for _, y in r["curve"]]
        ax.fill_between(xs, lo, hi, color="#1f77b4", alpha=0.35, lw=0)
        ax.plot(xs, lo, lw=0.5, color="#1f77b4")
        ax.set_yscale("log")
        for step, _, sev, _ in r["events"]:
            if sev == "alarm":
                ax.axvline(step, color="#d62728", lw=0.8)
            else:
                ax.plot([step], [0.02], marker="|", color="0.55", ms=5,
                        transform=ax.get_xaxis_transform())
        title = r["key"].replace("@", " @") + f", seed {r['seed']}" + (
            " (held out)" if r["long_held_out"] else "")
        ax.set_title(title, fontsize=7)
        ax.tick_params(labelsize=6, which="both")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle("Healthy long runs under the Monitor's defaults (the seed with the most alarms, "
                 "else the first): loss (each stretch's lowest, and its range shaded), alarms "
                 "red, notices grey", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)


FLOOR_FAMILIES = ("digits_mlp_adamw_label_smoothing", "wine_mlp_adam_dropout",
                  "digits_100_memorised_adam")


def _skips(args: tuple) -> dict:
    """One healthy long run under ``on_spike="skip"``: the steps it skipped; ``blind``: with
    the device rule never told the run's first loss (the rule before it judged a floor's
    rise)."""
    import torch

    torch.set_num_threads(1)
    import runner
    from families import FAMILIES

    from fasthealth.monitor import skip_rule

    name, seed, blind = args
    if blind:
        skip_rule.SkipRule.set_start = lambda self, start: None  # this worker process only
    torch.manual_seed(seed)
    out = runner.train(FAMILIES[name].build(torch.Generator().manual_seed(seed), LONG_STEPS),
                       LONG_STEPS, options={"on_spike": "skip"})
    skipped = [s.step for s in out["steps"] if s.values.get("spike_skip", 0) > 0]
    return {"kind": "skips", "name": name, "seed": seed, "blind": blind, "skipped": skipped}


def skips_at_floor(workers: int) -> dict:
    """Healthy steps skipped by ``on_spike="skip"`` in long runs at a floor, with the device
    rule told the run's first loss and without it (seed 0)."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(n, 0, blind) for n in FLOOR_FAMILIES for blind in (True, False)]
    # a fresh process per run: the blind variant patches the rule in its own process
    with ProcessPoolExecutor(workers, max_tasks_per_child=1) as pool:
        runs = list(pool.map(_skips, jobs))
    return {n: {("without the first loss" if r["blind"] else "with it"): r["skipped"]
                for r in runs if r["name"] == n} for n in FLOOR_FAMILIES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--final", action="store_true", help="also the held-out long runs")
    ap.add_argument("--only", help="comma-separated family/fault names")
    ap.add_argument("--label", help="key of the results in --out (default: the date and the "
                    "commit measured)")
    ap.add_argument("--note")
    ap.add_argument("--out", default=str(RESULTS / "long_runs.json"))
    ap.add_argument("--figure", default=str(RESULTS / "long_runs.png"))
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--skips", action="store_true",
                    help="only: the healthy steps on_spike='skip' skips in long runs at a floor, "
                    "with the device rule told the run's first loss and without it")
    args = ap.parse_args(argv)
    if args.skips:
        res = {"skipped": skips_at_floor(args.workers), "steps": LONG_STEPS, "seed": 0,
               "machine": eval_detectors.provenance(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        for name, by in res["skipped"].items():
            print(f"{name:<40}" + "  ".join(f"{k}: {len(v)}" for k, v in by.items()))
        out = Path(args.out)
        saved = json.loads(out.read_text()) if out.exists() else {}
        saved["skips_at_floor"] = res
        out.write_text(json.dumps(saved, indent=1))
        print(f"written: {out} [skips_at_floor]")
        return 0
    only = set(args.only.split(",")) if args.only else None
    res, runs = evaluate(args.final, args.workers, args.cache, only)
    res["machine"] = eval_detectors.provenance()
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.note:
        res["note"] = args.note
    print(table(res))
    label = eval_detectors.results_key(args.label, args.final, res["machine"].get("commit"),
                                       bool(res["machine"].get("monitor_modified")))
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[label] = res
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1))
    if args.figure:
        figure(runs, Path(args.figure))
    print(f"written: {out} [{label}]" + (f", {args.figure}" if args.figure else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
