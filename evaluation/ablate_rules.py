"""Which clauses of the rules earn their place: each switched off in turn, scored on the
tuning part of evaluation/detectors/. Never runs the held-out part.

    python evaluation/ablate_rules.py --cache build/detector-runs     # replays recorded runs

Every clause below was added for one corpus case. Under each setting (the defaults, then one
clause off) every tuning run is replayed through a fresh Monitor and scored as
``eval_detectors.py`` scores the defaults: alarms on healthy steps, fault runs caught within
their delay, faults with exactly one alarm incident in every run. A clause is kept only where
switching it off makes a tuning family alarm or a fault worse; the others are deleted from the
rules. Writes bench/results/rules_ablation.json (or --out) and prints the table.
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
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "detectors"))
sys.path.insert(0, str(HERE))

import eval_detectors as bd  # noqa: E402  (after the paths above)

INF = math.inf
# clause -> the Monitor options that switch it off ("incidents": IncidentConfig fields). The
# clauses this harness found unneeded are deleted from the rules, and so from here: the spike
# rule's linear-scale third path, its joint loss-and-norm path and its level-shift path, and
# the update-ratio precursor's loss-falling veto (bench/results/rules_ablation.json).
CLAUSES: dict[str, dict] = {
    "spike.early (before the window is armed)": {
        "rules": {"spike": {"early_loss": INF, "early_grad_norm": INF}}},
    "grad_trend.confirm (loss confirms -> alarm)": {"rules": {"grad_trend": {"confirm": None}}},
    "grad_trend.lr_rise (schedule's climb exempt)": {"rules": {"grad_trend": {"lr_rise": INF}}},
    "lr_jump.climb (a climb judged as a whole)": {"rules": {"lr_jump": {"climb": False}}},
    "incidents.overflow_explains (1.8e19 gate)": {"incidents": {"overflow_explains": False}},
    "incidents.settle (a new kind is a new fault)": {"incidents": {"settle": None}},
    "incidents.returns (a spike back to the level)": {"incidents": {"returns": False}},
}


TOGETHER = "every clause marked delete, together"


def merged(names: list[str]) -> dict:
    """The options that switch all of ``names`` off at once."""
    out: dict = {"rules": {}, "incidents": {}}
    for n in names:
        for key, value in CLAUSES[n].items():
            if key == "rules":
                for rule, fields in value.items():
                    out["rules"].setdefault(rule, {}).update(fields)
            else:
                out[key].update(value)
    return {k: v for k, v in out.items() if v}


SETTINGS: dict[str, dict] = {}


def grid() -> list[dict]:
    return [{}] + list(SETTINGS.values())


def one_incident_faults(faults: dict) -> int:
    """Faults whose every run has exactly one alarm incident from its onset on."""
    return sum(all(x["alarm_incidents_after"] == 1 for x in row["runs"])
               for row in faults.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, help="recorded runs (eval_detectors.py --cache)")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(RESULTS / "rules_ablation.json"))
    ap.add_argument("--together", help="clauses separated by ';' (names as in CLAUSES, or "
                    "'all') also scored switched off together")
    ap.add_argument("--only-together", action="store_true",
                    help="score the defaults and the --together setting alone")
    args = ap.parse_args(argv)
    t0 = time.time()
    if not args.only_together:
        SETTINGS.update(CLAUSES)
    if args.together:
        names = list(CLAUSES) if args.together == "all" else [
            n.strip() for n in args.together.split(";")]
        unknown = [n for n in names if n not in CLAUSES]
        if unknown:
            ap.error(f"--together: no clause {unknown[0]!r}")
        SETTINGS[TOGETHER] = merged(names)
    size = {"seeds": range(args.seeds), "grid": grid()}
    jobs = bd.jobs_for(size, final=False, cache=args.cache)
    # bd.usable keeps only Monitor options; "incidents" is this harness's own (runner.replay)
    jobs = [(*j[:3], grid(), j[4]) for j in jobs]
    runs = bd.run_all(jobs, args.workers, progress=True)
    names = ["defaults"] + list(SETTINGS)
    rows = []
    for k, name in enumerate(names):
        sc = bd.score(runs, grid(), lambda r, k=k: k)
        t = sc["totals"]
        rows.append({"setting": name, "options": grid()[k], **t,
                     "faults_one_alarm_incident": one_incident_faults(sc["faults"]),
                     "families_alarming": sorted(g for g, r in sc["families"].items()
                                                 if r["alarms"]),
                     "faults_missed": {n: len(r["runs"]) - r["caught"]
                                       for n, r in sc["faults"].items()
                                       if r["caught"] < len(r["runs"])},
                     "faults_not_one_incident": sorted(
                         n for n, r in sc["faults"].items()
                         if not all(x["alarm_incidents_after"] == 1 for x in r["runs"]))})
    base = rows[0]
    print(f"{'setting':48} {'alarms':>6} {'fam':>4} {'caught':>7} {'1 inc':>5} "
          f"{'notices/10k':>11}  verdict")
    for r in rows:
        worse = (r["alarms"] > base["alarms"]
                 or r["fault_runs_caught"] < base["fault_runs_caught"]
                 or r["faults_one_alarm_incident"] < base["faults_one_alarm_incident"]
                 or r["notices_per_10k"] > base["notices_per_10k"] + 0.5)
        r["needed"] = None if r is base else worse
        mark = "" if r is base else ("keep" if worse else "delete")
        print(f"{r['setting']:48} {r['alarms']:>6} {r['families_with_alarms']:>4} "
              f"{r['fault_runs_caught']:>3}/{r['fault_runs']:<3} "
              f"{r['faults_one_alarm_incident']:>5} {r['notices_per_10k']:>11}  {mark}")
    res = {"what": __doc__.split("\n\n")[0], "seeds": args.seeds,
           "rule": "delete a clause when switching it off adds no alarm, misses no fault run, "
                   "splits no fault's incident and adds at most 0.5 notices per 10k healthy "
                   "steps", "runs": len(runs),
           "cached_runs": sum(r["cached"] for r in runs), "rows": rows,
           "machine": bd.describe(), "provenance": bd.provenance(),
           "wall_seconds": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {args.out} ({res['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
