"""`make bench` several times: the CPU benchmark (bench/harness.py) run N times, each in a
process of its own as `make bench` runs it, and the figures the README gives: per case, the
median over the runs of each run's median, and the range (lowest and highest run).

One run is one state of a shared machine: its figures move by tens of percent between runs
(docs/performance.md), so no single run, and never the best one, stands for the code. The load
average is read before each run and kept with it.

    python bench/bench_runs.py --runs 3 --out bench/results   # writes cpu_runs.json

The runs' own files (cpu.json and its plots) go to a temporary folder unless --keep-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HARNESS = Path(__file__).resolve().parent / "harness.py"

# What the README's table shows, per case: (label, provider or ratio key)
FIGURES = (
    ("fasthealth_ms", "fasthealth", "ms"),
    ("naive_ms", "naive", "ms"),
    ("total_norm_ms", "total_norm", "ms"),
    ("read_limit_ms", "read_limit", "ms"),
    ("x_read_limit", "fasthealth", "x_read_paired_median"),
    ("x_faster_than_total_norm", "fasthealth", "x_faster_than_total_norm_paired_median"),
)


def summarize(runs: list[dict]) -> list[dict]:
    """Per (case, dtype): each figure's median over the runs and its range [lowest, highest],
    and how many of the runs met each goal."""
    out = []
    cases = dict.fromkeys((r["case"], r["dtype"]) for run in runs for r in run["rows"])
    for case, dtype in cases:
        row: dict = {"case": case, "dtype": dtype}
        for label, provider, key in FIGURES:
            vals = [r[key] for run in runs for r in run["rows"]
                    if (r["case"], r["dtype"], r["provider"]) == (case, dtype, provider)
                    and key in r]
            if vals:
                row[label] = {"median": round(statistics.median(vals), 3),
                              "range": [round(min(vals), 3), round(max(vals), 3)],
                              "runs": len(vals)}
        if "naive_ms" in row and "fasthealth_ms" in row:
            vals = [n / f for n, f in zip(_per_run(runs, case, dtype, "naive"),
                                          _per_run(runs, case, dtype, "fasthealth"))]
            row["x_faster_than_naive"] = {"median": round(statistics.median(vals), 1),
                                          "range": [round(min(vals), 1), round(max(vals), 1)],
                                          "runs": len(vals)}
        goals = [g for run in runs for g in run.get("goals", [])
                 if g["goal"].startswith(f"{case} {dtype}:")]
        row["goals_met"] = {name: f"{sum(g['met'] for g in goals if g['goal'] == name)}/"
                                  f"{sum(g['goal'] == name for g in goals)}"
                            for name in dict.fromkeys(g["goal"] for g in goals)}
        out.append(row)
    return out


def _per_run(runs: list[dict], case: str, dtype: str, provider: str) -> list[float]:
    return [r["ms"] for run in runs for r in run["rows"]
            if (r["case"], r["dtype"], r["provider"]) == (case, dtype, provider)]


def text(summary: list[dict], n: int) -> str:
    lines = [f"median of {n} runs [lowest-highest run]"]
    for s in summary:
        parts = []
        for label, _, _ in FIGURES + (("x_faster_than_naive", None, None),):
            if label in s:
                lo, hi = s[label]["range"]
                parts.append(f"{label} {s[label]['median']:g} [{lo:g}-{hi:g}]")
        lines.append(f"  {s['case']} {s['dtype']}: " + ", ".join(parts))
        for goal, met in s["goals_met"].items():
            lines.append(f"    goal {goal.split(': ', 1)[1]}: met in {met} runs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench/results", help="folder for cpu_runs.json")
    ap.add_argument("--keep-runs", action="store_true", help="keep each run's folder in --out")
    ap.add_argument("harness_args", nargs="*", help="passed to harness.py (after --)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            folder = out / f"cpu_run{i + 1}" if args.keep_runs else Path(tmp) / f"run{i + 1}"
            load = os.getloadavg()
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            t0 = time.perf_counter()
            print(f"== run {i + 1}/{args.runs}, {started}, load average {load[0]:.2f} "
                  f"{load[1]:.2f} {load[2]:.2f}", flush=True)
            subprocess.run([sys.executable, str(HARNESS), "--out", str(folder),
                            *args.harness_args], check=True)
            res = json.loads(next(folder.glob("cpu*.json")).read_text())
            res["run"] = {"started": started, "load_average_before": [round(x, 2) for x in load],
                          "seconds": round(time.perf_counter() - t0, 1)}
            runs.append(res)
    summary = summarize(runs)
    doc = {"runs": runs, "summary": summary,
           "method": f"{args.runs} runs of {' '.join(['bench/harness.py', *args.harness_args])}, "
                     "one after another, each in its own process; per figure the median over "
                     "the runs of each run's median, and the lowest and highest run"}
    path = out / "cpu_runs.json"
    path.write_text(json.dumps(doc, indent=1))
    print(text(summary, len(runs)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
