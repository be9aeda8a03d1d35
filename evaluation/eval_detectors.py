"""Evaluates the Monitor's event rules on the corpus of evaluation/detectors/, leave one family out.

    python evaluation/eval_detectors.py --label before   # tuning families, 6 seeds: ~15 min
    python evaluation/eval_detectors.py --quick          # one seed, defaults only (the tests' size)
    python evaluation/eval_detectors.py --final          # also the held-out families, once
    python evaluation/eval_detectors.py --cache build/detector-runs   # while tuning host rules:
                                       # replays earlier recordings instead of training again

Every run is a real training loop under ``fh.Monitor`` at its defaults; its recorded steps are
then replayed through fresh Monitors under each setting of ``GRID`` (Monitor constructor
options: the thresholds that matter), so that a grid costs no second training run.

Scores, per setting: for a healthy family, its alarms and notices per 10,000 healthy steps
(every alarm of a healthy run is false, and so is one of a faulty run before its onset); for a
fault, whether an *alarm* of one of its expected kinds came at or after its onset within its
allowed delay (``caught``; ``noticed`` counts notices too), the delay, and the events, alarms,
notices and incidents from its onset to the end of the run (one incident per fault is the aim;
``alarm_incidents_after`` counts the alarm ones: a notice incident long after the onset is the
family's own background, as on its healthy runs).
A Monitor without severities counts every event as an alarm; one without incidents reports
none (None).

Leave one family out: for every family (a fault goes with the family it is planted in), the
setting is chosen on all the *other* tuning families and faults (fewest runs with a false alarm
or a miss, then fewest alarms, then fewest notices, then the defaults), then that family is
scored under it. The held-out families and faults (``corpus.HELD_OUT_*``: never run while
choosing) are run only with ``--final``, scored under the setting chosen on every tuning family
and under the defaults.

Writes bench/results/detectors.json (or --out) under ``--label`` (other labels in the file are
kept, so that "before" and "after" sit side by side), and prints the tables.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite
# this checkout's fasthealth, not whichever one is installed (an editable install of another
# worktree would otherwise be what gets measured)
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "detectors"))

# Monitor options to choose from ({} = the Monitor's defaults, always first). Options the
# Monitor does not take are dropped (a setting left empty by that is dropped too).
GRID = [{}] + [{"spike_zscore": z, "warmup_steps": w} for z in (6.0, 8.0, 11.0, 16.0)
               for w in (20, 60) if (z, w) != (6.0, 20)]
FULL = {"seeds": range(6), "grid": GRID}
QUICK = {"seeds": range(1), "grid": [{}]}
FAULT_SEED = 1000  # fault runs use seed + FAULT_SEED: their steps before the onset are new data


def usable(grid: list[dict]) -> list[dict]:
    """``grid`` less the options ``fh.Monitor`` does not take; the defaults first, once."""
    import fasthealth as fh

    known = set(inspect.signature(fh.Monitor).parameters)
    out: list[dict] = [{}]
    for opts in grid:
        kept = {k: v for k, v in opts.items() if k in known}
        if kept and kept not in out:
            out.append(kept)
    return out


def _job(args: tuple) -> dict:
    import torch

    torch.set_num_threads(1)
    import corpus

    kind, name, seed, options, cache = args
    r = corpus.run(kind, name, seed, options=options, cache=cache)
    # a cached run's training-time events are its replay's: nothing to compare
    r["faithful"] = None if r["cached"] else (
        [e[:3] for e in r["events"]] == [e[:3] for e in r["replays"][0]["events"]])
    return r


def jobs_for(size: dict, final: bool, only: set[str] | None = None,
             cache: Path | None = None) -> list[tuple]:
    import corpus

    healthy = dict(corpus.HEALTHY, **(corpus.HELD_OUT_HEALTHY if final else {}))
    faults = dict(corpus.TUNING_FAULTS, **(corpus.HELD_OUT_FAULTS if final else {}))
    grid = usable(size["grid"])
    jobs = [("healthy", n, s, grid, cache) for n in healthy for s in size["seeds"]]
    jobs += [("fault", n, s + FAULT_SEED, grid, cache) for n in faults for s in size["seeds"]]
    if only:
        jobs = [j for j in jobs if j[1] in only]
    # the longest first, so that two workers finish together
    cost = {n: f.steps * (3 if "transformer" in n or "bf16" in n else 1)
            for n, f in {**healthy, **faults}.items()}
    return sorted(jobs, key=lambda j: -cost[j[1]])


def run_all(jobs: list[tuple], workers: int, progress: bool) -> list[dict]:
    return run_all_with(_job, jobs, workers, progress, "detector corpus")


def run_all_with(job, jobs: list[tuple], workers: int, progress: bool, what: str
                 ) -> list[dict]:
    """``job(j)`` for every ``j`` of ``jobs`` in ``workers`` processes, with a progress bar."""
    bar = None
    if progress:
        from tqdm import tqdm  # only for the interactive bar

        bar = tqdm(total=len(jobs), desc=what, unit="run", file=sys.stderr)
    runs = []
    with ProcessPoolExecutor(workers) as pool:
        for fut in as_completed([pool.submit(job, j) for j in jobs]):
            runs.append(fut.result())
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return sorted(runs, key=lambda r: (r["kind"], r["name"], r["seed"]))


# ---- verdicts -------------------------------------------------------------------------------

def verdict(r: dict, k: int) -> dict:
    """Run ``r`` judged under setting ``k`` of its grid."""
    events, incidents = r["replays"][k]["events"], r["replays"][k]["incidents"]
    onset = r["onset"]
    healthy_steps = r["steps"] if onset is None else onset
    before = [e for e in events if onset is None or e[0] < onset]
    v = {"healthy_steps": healthy_steps,
         "alarms": [(s, kind) for s, kind, sev, _ in before if sev == "alarm"],
         "notices": [(s, kind) for s, kind, sev, _ in before if sev != "alarm"],
         "false_incidents": None if incidents is None else sum(
             1 for i in incidents if i[3] == "alarm" and (onset is None or i[1] < onset))}
    if onset is None:
        return v
    after = [e for e in events if e[0] >= onset]
    alarm_hits = [s for s, kind, sev, _ in after if kind in r["expect"] and sev == "alarm"]
    any_hits = [s for s, kind, sev, _ in after if kind in r["expect"]]
    delay = alarm_hits[0] - onset if alarm_hits else None
    v.update({
        "caught": delay is not None and delay <= r["max_delay"], "delay": delay,
        "noticed": bool(any_hits) and any_hits[0] - onset <= r["max_delay"],
        "events_after": len(after),
        "alarms_after": sum(1 for e in after if e[2] == "alarm"),
        "notices_after": sum(1 for e in after if e[2] != "alarm"),
        "incidents_after": None if incidents is None else sum(
            1 for i in incidents if i[1] is not None and i[1] >= onset),
        "alarm_incidents_after": None if incidents is None else sum(
            1 for i in incidents if i[1] is not None and i[1] >= onset and i[3] == "alarm"),
        "kinds": sorted({e[1] for e in after}),
    })
    return v


def bad(v: dict) -> bool:
    return bool(v["alarms"]) or v.get("caught") is False


def objective(runs: list[dict], k: int) -> tuple:
    vs = [verdict(r, k) for r in runs]
    return (sum(bad(v) for v in vs), sum(len(v["alarms"]) for v in vs),
            sum(len(v["notices"]) for v in vs), k)


def choose(runs: list[dict], n: int) -> int:
    return min(range(n), key=lambda k: objective(runs, k))


# ---- tables of figures ----------------------------------------------------------------------

def per_10k(count: int, steps: int) -> float:
    return round(1e4 * count / steps, 2) if steps else 0.0


def family_rows(runs: list[dict], pick) -> dict:
    """Per group: healthy steps (healthy runs and faulty runs before their onset), alarms and
    notices per 10,000 of them, under the setting ``pick(run)``."""
    rows: dict[str, dict] = {}
    for r in runs:
        v = verdict(r, pick(r))
        row = rows.setdefault(r["group"], {"runs": 0, "healthy_steps": 0, "alarms": 0,
                                           "notices": 0, "false_incidents": None,
                                           "runs_with_alarm": 0, "alarm_kinds": Counter(),
                                           "alarm_list": []})
        row["runs"] += r["kind"] == "healthy"
        row["healthy_steps"] += v["healthy_steps"]
        row["alarms"] += len(v["alarms"])
        row["notices"] += len(v["notices"])
        row["runs_with_alarm"] += bool(v["alarms"])
        row["alarm_kinds"].update(k for _, k in v["alarms"])
        row["alarm_list"] += [(r["name"], r["seed"], s, k) for s, k in v["alarms"]]
        if v["false_incidents"] is not None:
            row["false_incidents"] = (row["false_incidents"] or 0) + v["false_incidents"]
    rows = {g: row for g, row in rows.items() if row["healthy_steps"]}
    for row in rows.values():
        row["alarms_per_10k"] = per_10k(row["alarms"], row["healthy_steps"])
        row["notices_per_10k"] = per_10k(row["notices"], row["healthy_steps"])
        row["alarm_kinds"] = dict(row["alarm_kinds"])
    return dict(sorted(rows.items()))


def fault_rows(runs: list[dict], pick) -> dict:
    rows: dict[str, dict] = {}
    for r in runs:
        if r["kind"] != "fault":
            continue
        v = verdict(r, pick(r))
        row = rows.setdefault(r["name"], {"group": r["group"], "expect": r["expect"],
                                          "max_delay": r["max_delay"], "runs": []})
        row["runs"].append({"seed": r["seed"], "onset": r["onset"], **{
            k: v[k] for k in ("caught", "noticed", "delay", "events_after", "alarms_after",
                              "notices_after", "incidents_after", "alarm_incidents_after",
                              "kinds")}})
    for row in rows.values():
        rs = row["runs"]
        row["caught"] = sum(x["caught"] for x in rs)
        row["noticed"] = sum(x["noticed"] for x in rs)
        row["delays"] = [x["delay"] for x in rs]
        for key in ("events_after", "alarms_after", "notices_after", "incidents_after",
                    "alarm_incidents_after"):
            xs = [x[key] for x in rs if x[key] is not None]
            row[f"mean_{key}"] = round(sum(xs) / len(xs), 1) if xs else None
            row[f"max_{key}"] = max(xs) if xs else None
        row["kinds"] = sorted({k for x in rs for k in x["kinds"]})
    return dict(sorted(rows.items()))


def totals(fam: dict, faults: dict) -> dict:
    steps = sum(r["healthy_steps"] for r in fam.values())
    alarms = sum(r["alarms"] for r in fam.values())
    notices = sum(r["notices"] for r in fam.values())
    return {"healthy_steps": steps, "alarms": alarms, "notices": notices,
            "alarms_per_10k": per_10k(alarms, steps), "notices_per_10k": per_10k(notices, steps),
            "families_with_alarms": sum(1 for r in fam.values() if r["alarms"] and r["runs"]),
            "families": sum(1 for r in fam.values() if r["runs"]),
            "fault_runs": sum(len(r["runs"]) for r in faults.values()),
            "fault_runs_caught": sum(r["caught"] for r in faults.values()),
            "faults_always_caught": sum(r["caught"] == len(r["runs"]) for r in faults.values()),
            "faults": len(faults)}


def score(runs: list[dict], grid: list[dict], pick) -> dict:
    fam, faults = family_rows(runs, pick), fault_rows(runs, pick)
    return {"totals": totals(fam, faults), "families": fam, "faults": faults}


def leave_one_family_out(runs: list[dict], grid: list[dict]) -> tuple[dict, dict]:
    """Per group, the setting chosen without it; and the scores of each group under its own."""
    chosen = {}
    for group in sorted({r["group"] for r in runs}):
        chosen[group] = choose([r for r in runs if r["group"] != group], len(grid))
    return chosen, score(runs, grid, lambda r: chosen[r["group"]])


def _brief(v: dict) -> list:
    """[alarms, notices, delay, caught] of a verdict (the last two None for a healthy run)."""
    return [len(v["alarms"]), len(v["notices"]), v.get("delay"), v.get("caught")]


def evaluate(size: dict, workers: int = 2, progress: bool = True, final: bool = False,
             only: set[str] | None = None, cache: Path | None = None) -> dict:
    """Runs the corpus at ``size`` and scores it; with ``final`` the held-out part too; with
    ``cache`` (a folder), runs recorded there before with the same sources are replayed, not
    trained again."""
    t0 = time.time()
    grid = usable(size["grid"])
    import corpus

    runs = run_all(jobs_for(size, final, only, cache), workers, progress)
    held_names = set(corpus.HELD_OUT_HEALTHY) | set(corpus.HELD_OUT_FAULTS)
    tuning = [r for r in runs if r["name"] not in held_names]
    held = [r for r in runs if r["name"] in held_names]
    chosen, lofo = leave_one_family_out(tuning, grid)
    res = {
        "seeds": list(size["seeds"]), "grid": grid,
        "faithful_replays": sum(r["faithful"] is True for r in runs), "runs": len(runs),
        "cached_runs": sum(r["cached"] for r in runs),
        "unfaithful": [(r["name"], r["seed"]) for r in runs if r["faithful"] is False],
        "defaults": score(tuning, grid, lambda r: 0),
        "leave_one_family_out": {"chosen": {g: grid[k] for g, k in chosen.items()}, **lofo},
        "per_setting": [score(tuning, grid, lambda r, k=k: k)["totals"]
                        for k in range(len(grid))],
        "per_run": {f"{r['name']}/{r['seed']}": [_brief(verdict(r, k)) for k in range(len(grid))]
                    for r in runs},
        "loss": {f"{r['name']}/{r['seed']}": [r["loss_first"], r["loss_last"]] for r in runs},
        "seconds": {f"{r['name']}/{r['seed']}": [r["seconds"], r["cpu_seconds"]] for r in runs},
        "run_seconds": round(sum(r["seconds"] for r in runs), 1),
        "train_seconds": round(sum(r["train_seconds"] for r in runs), 1),
    }
    if final:
        k = choose(tuning, len(grid))
        res["final"] = {"chosen_on_all_tuning": grid[k],
                        "held_out_defaults": score(held, grid, lambda r: 0),
                        "held_out_chosen": score(held, grid, lambda r: k)}
    res["wall_seconds"] = round(time.time() - t0, 1)
    return res


# ---- printing -------------------------------------------------------------------------------

def _fmt(x) -> str:
    return "-" if x is None else str(x)


def table(res: dict) -> str:
    d, lo = res["defaults"], res["leave_one_family_out"]
    lines = [f"seeds {res['seeds']}; {len(res['grid'])} settings; replays faithful to training: "
             f"{res['faithful_replays']}/{res['runs'] - res.get('cached_runs', 0)} "
             f"({res.get('cached_runs', 0)} runs replayed from the cache); "
             f"{res['wall_seconds']} s wall",
             "",
             f"{'healthy family':<42}{'steps':>7} {'alarms/10k':>10} {'notices/10k':>11} "
             f"{'LOFO alarms/10k':>15}  alarm kinds at the defaults"]
    for name, row in d["families"].items():
        lrow = lo["families"][name]
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["alarm_kinds"].items()))
        if not row["runs"]:
            name = f"({name}: before onset)"
        lines.append(f"{name:<42}{row['healthy_steps']:>7} {row['alarms_per_10k']:>10} "
                     f"{row['notices_per_10k']:>11} {lrow['alarms_per_10k']:>15}  {kinds}")
    t, lt = d["totals"], lo["totals"]
    lines.append(f"{'all':<42}{t['healthy_steps']:>7} {t['alarms_per_10k']:>10} "
                 f"{t['notices_per_10k']:>11} {lt['alarms_per_10k']:>15}  "
                 f"({t['families_with_alarms']}/{t['families']} families alarm at the defaults, "
                 f"{lt['families_with_alarms']} left out)")
    lines += ["", f"{'fault':<34}{'caught':>7} {'delays':>16} {'allowed':>7} {'alarms':>7} "
                  f"{'notices':>7} {'incid.':>6} {'alarm':>5} {'LOFO':>5}  kinds after onset"]
    for name, row in d["faults"].items():
        lrow = lo["faults"][name]
        delays = ",".join(_fmt(x) for x in row["delays"])
        lines.append(f"{name:<34}{row['caught']:>3}/{len(row['runs']):<3} {delays:>16} "
                     f"{row['max_delay']:>7} {_fmt(row['mean_alarms_after']):>7} "
                     f"{_fmt(row['mean_notices_after']):>7} "
                     f"{_fmt(row['mean_incidents_after']):>6} "
                     f"{_fmt(row['mean_alarm_incidents_after']):>5} "
                     f"{lrow['caught']:>2}/{len(lrow['runs']):<2}  {', '.join(row['kinds'])}")
    lines.append(f"caught within the allowed delay: {t['fault_runs_caught']}/{t['fault_runs']} "
                 f"runs at the defaults, {lt['fault_runs_caught']}/{lt['fault_runs']} left out "
                 "(alarms, notices, incidents, alarm incidents: means per run from the onset on)")
    by_setting = Counter(json.dumps(c, sort_keys=True) for c in lo["chosen"].values())
    lines.append("settings chosen without the family: " + "; ".join(
        f"{'defaults' if c == '{}' else c} for {n}" for c, n in by_setting.most_common()))
    lines += ["", f"{'every tuning family under one setting':<42}{'alarms/10k':>10} "
                  f"{'families alarming':>18} {'fault runs caught':>18}"]
    for opts, t in zip(res["grid"], res["per_setting"]):
        lines.append(f"{json.dumps(opts) if opts else 'defaults':<42}{t['alarms_per_10k']:>10} "
                     f"{t['families_with_alarms']:>11}/{t['families']:<6} "
                     f"{t['fault_runs_caught']:>11}/{t['fault_runs']}")
    if "final" in res:
        f = res["final"]
        chosen = f"chosen on all tuning: {f['chosen_on_all_tuning']}"
        for key, title in (("held_out_defaults", "defaults"), ("held_out_chosen", chosen)):
            h = f[key]["totals"]
            lines += ["", f"HELD OUT, {title}: {h['alarms_per_10k']} alarms/10k and "
                          f"{h['notices_per_10k']} notices/10k over {h['healthy_steps']} steps "
                          f"({h['families_with_alarms']}/{h['families']} families alarm); "
                          f"faults caught {h['fault_runs_caught']}/{h['fault_runs']} runs"]
            for name, row in f[key]["families"].items():
                lines.append(f"  {name:<40}{row['alarms_per_10k']:>8} {row['notices_per_10k']:>8}"
                             f"  {row['alarm_kinds']}")
            for name, row in f[key]["faults"].items():
                lines.append(f"  {name:<40}{row['caught']}/{len(row['runs'])} delays "
                             f"{row['delays']} (allowed {row['max_delay']}) events "
                             f"{row['mean_events_after']} incidents "
                             f"{row['mean_incidents_after']} (alarm "
                             f"{row['mean_alarm_incidents_after']})")
    return "\n".join(lines)


def describe() -> dict:
    import corpus
    from families import FAMILIES
    from faults import FAULTS

    return {"families": {n: {"about": f.about, "steps": f.steps, "held_out": f.held_out,
                             "long": f.long} for n, f in FAMILIES.items()},
            "faults": {n: {"about": f.about, "in": f.group, "steps": f.steps,
                           "onset": f.onset, "expect": list(f.expect),
                           "max_delay": f.max_delay, "held_out": f.held_out}
                       for n, f in FAULTS.items()},
            "held_out": sorted(corpus.HELD_OUT_HEALTHY) + sorted(corpus.HELD_OUT_FAULTS)}


def provenance() -> dict:
    import torch

    import fasthealth

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):  # not a checkout
            return None

    package = Path(fasthealth.__file__).resolve().parent
    own = package == HERE.parent / "fasthealth"  # a path of this machine's names nothing
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cpus": os.cpu_count(), "fasthealth": "fasthealth" if own else str(package)}
    if own:
        out["commit"] = git("rev-parse", "HEAD")
        out["monitor_modified"] = bool(git("status", "--porcelain", "--", "fasthealth/monitor"))
    elif (package.parent / "COMMIT").exists():  # an exported copy: the commit it was taken at
        out["commit"] = (package.parent / "COMMIT").read_text().strip()
    return out


def results_key(label: str | None, final: bool, commit: str | None,
                modified: bool = False) -> str:
    """The key of a run's results in its file (every evaluation script's): ``label`` when
    given, else the date and the commit of the code measured ("+" when the monitor's files
    differed from it); " with held out" when the held-out part was scored."""
    if label:
        return label
    key = f"{time.strftime('%Y-%m-%d', time.gmtime())} {(commit or 'no commit')[:7]}"
    return key + ("+" if modified else "") + (" with held out" if final else "")


def save(path: Path, label: str, res: dict) -> None:
    out = json.loads(path.read_text()) if path.exists() else {}
    if "calibration" in out:  # the first corpus's file: kept as it was
        out = {"first_corpus": out}
    out["corpus"] = describe()
    out[label] = res
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=list))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one seed, the defaults only")
    ap.add_argument("--final", action="store_true",
                    help="also run and score the held-out families and faults")
    ap.add_argument("--seeds", type=int, help="seeds per family (default 6; --quick 1)")
    ap.add_argument("--only", help="comma-separated family/fault names (tuning ones)")
    ap.add_argument("--label", help="key of the results in --out (default: the date and the "
                    "commit measured)")
    ap.add_argument("--note", help="a line kept with the results (what was measured)")
    ap.add_argument("--out", default=str(RESULTS / "detectors.json"))
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--cache", type=Path, help="a folder for the runs' recorded steps: a run "
                    "recorded there with the same sources is replayed, not trained (while "
                    "tuning the host rules; results for the record come from a run without it)")
    args = ap.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    if args.seeds:
        size["seeds"] = range(args.seeds)
    only = set(args.only.split(",")) if args.only else None
    res = evaluate(size, args.workers, final=args.final, only=only, cache=args.cache)
    res["machine"] = provenance()
    if args.note:
        res["note"] = args.note
    print(table(res))
    key = results_key(args.label, args.final, res["machine"].get("commit"),
                      bool(res["machine"].get("monitor_modified")))
    save(Path(args.out), key, res)
    print(f"written: {args.out} [{key}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
