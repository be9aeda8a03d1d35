"""Where the alarms for faults that do not show in the loss (weight_corruption, repeated_batch,
no_grad, overflow_streak) fire in the detector corpus (evaluation/detectors/), one seed of every
tuning family and fault at the Monitor's defaults: a healthy family must raise none of them,
and a fault's verdict must be what it was (a new kind may only join the fault's own incident).
Writes bench/results/new_alarms_corpus.json.

    OMP_NUM_THREADS=1 python evaluation/eval_silent_alarms.py [--workers 2]
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite
sys.path[:0] = [str(HERE), str(HERE / "detectors")]

import eval_detectors as bd  # noqa: E402

NEW = {"weight_corruption", "repeated_batch", "no_grad", "overflow_streak"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "new_alarms_corpus.json"))
    args = ap.parse_args(argv)
    runs = bd.run_all(bd.jobs_for(bd.QUICK, False), args.workers, False)
    out: dict = {"healthy": {}, "faults": {}, "date": time.strftime("%Y-%m-%d")}
    for r in runs:
        new = [list(e[:4]) for e in r["events"] if e[1] in NEW]
        v = bd.verdict(r, 0)
        row = {"new_events": new,
               "incidents_of_new": sorted({e[3] for e in new}),
               "verdict": {k: v.get(k) for k in ("caught", "delay", "false_incidents",
                                                 "alarm_incidents_after")},
               "incident_of_first_alarm_after_onset": next(
                   (e[3] for e in r["events"] if e[2] == "alarm"
                    and (r["onset"] is None or e[0] >= r["onset"])), None)}
        out["healthy" if r["kind"] == "healthy" else "faults"][r["name"]] = row
    out["healthy_with_a_new_alarm"] = [n for n, x in out["healthy"].items() if x["new_events"]]
    out["faults_where_a_new_kind_opened_its_own_incident"] = [
        n for n, x in out["faults"].items()
        if any(i != x["incident_of_first_alarm_after_onset"] for i in x["incidents_of_new"])]
    print(json.dumps({k: out[k] for k in ("healthy_with_a_new_alarm",
                                          "faults_where_a_new_kind_opened_its_own_incident")}))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
