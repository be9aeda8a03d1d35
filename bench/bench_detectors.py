"""Evaluates the Monitor's event rules on the corpus of bench/detectors/corpus.py.

    python bench/bench_detectors.py            # calibration and held-out seeds; ~7 min
    python bench/bench_detectors.py --quick    # the CI size: one seed of every run

Writes bench/results/detectors.json (or --out) and prints a table: false alarms per healthy
step (every event of a healthy run is one, and so is any event of a faulty run before its
onset), and for each fault whether one of its expected kinds fired within its allowed delay,
and after how many steps. Runs go to two worker processes (one torch thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "detectors"))

# Calibration: the thresholds in fasthealth/monitor/detectors.py were chosen on these seeds.
# Second round: held out in the first round; its 3 false alarms and 2 misses were then looked
# at to revise the rules, so it is calibration data now. Held out: seeds never looked at while
# choosing or revising the rules; their table is the honest estimate.
FULL = {"seeds": range(5), "healthy_steps": 700, "fault_steps": 500}
SECOND_ROUND = {"seeds": range(5, 15), "fault_seeds": range(5, 10), "healthy_steps": 700,
                "fault_steps": 500}
HELD_OUT = {"seeds": range(15, 30), "fault_seeds": range(10, 20), "healthy_steps": 700,
            "fault_steps": 500}
QUICK = {"seeds": range(1), "healthy_steps": 700, "fault_steps": 500}


def _job(args: tuple[str, str, int, int]) -> dict:
    import torch

    torch.set_num_threads(1)
    import corpus

    which, name, seed, steps = args
    t0 = time.time()
    run = corpus.run_healthy if which == "healthy" else corpus.run_fault
    r = run(name, seed, steps)
    r.pop("curve")
    r["seconds"] = round(time.time() - t0, 2)
    return r


def judge(r: dict) -> dict:
    """A run's verdict: its false alarms, and for a fault its first expected event."""
    onset = r.get("onset")
    events = [(s, k) for s, k, _ in r["events"]]
    if onset is None:
        return {"false_alarms": events, "healthy_steps": r["steps"]}
    before = [(s, k) for s, k in events if s < onset]
    hits = [s for s, k in events if k in r["expect"] and s >= onset]
    delay = hits[0] - onset if hits else None
    caught = delay is not None and delay <= r["max_delay"]
    return {"false_alarms": before, "healthy_steps": onset, "caught": caught, "delay": delay,
            "kinds": sorted({k for s, k in events if s >= onset})}


def evaluate(size: dict, workers: int = 2, progress: bool = True) -> dict:
    import corpus

    jobs = [("healthy", n, seed, size["healthy_steps"]) for n in corpus.HEALTHY
            for seed in size["seeds"]]
    jobs += [("fault", n, seed, size["fault_steps"]) for n in corpus.FAULTS
             for seed in size.get("fault_seeds", size["seeds"])]
    runs = []
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc="detector corpus", unit="run", file=sys.stderr)
        except ImportError:
            pass
    with ProcessPoolExecutor(workers) as pool:
        for r in pool.map(_job, jobs):
            r.update(judge(r))
            runs.append(r)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return summarize(runs, size)


def summarize(runs: list[dict], size: dict) -> dict:
    healthy_steps = sum(r["healthy_steps"] for r in runs)
    alarms = [(r["kind"], r["seed"], s, k) for r in runs for s, k in r["false_alarms"]]
    faults: dict[str, dict] = {}
    for r in runs:
        if r.get("onset") is None:
            continue
        f = faults.setdefault(r["kind"], {"expect": list(r["expect"]),
                                          "max_delay": r["max_delay"], "runs": []})
        f["runs"].append({"seed": r["seed"], "onset": r["onset"], "caught": r["caught"],
                          "delay": r["delay"], "kinds": r["kinds"]})
    for f in faults.values():
        f["caught"] = sum(x["caught"] for x in f["runs"])
        delays = [x["delay"] for x in f["runs"] if x["caught"]]
        f["max_observed_delay"] = max(delays) if delays else None
    return {
        "size": {k: (list(v) if isinstance(v, range) else v) for k, v in size.items()},
        "healthy_kinds": sorted({r["kind"] for r in runs if r.get("onset") is None}),
        "healthy_steps": healthy_steps,
        "false_alarms": len(alarms),
        "false_alarms_per_step": len(alarms) / max(healthy_steps, 1),
        "false_alarm_list": alarms,
        "faults": faults,
        "seconds": round(sum(r["seconds"] for r in runs), 1),
    }


def table(res: dict) -> str:
    seeds = res["size"]["seeds"]
    lines = [f"healthy steps: {res['healthy_steps']} over {len(res['healthy_kinds'])} kinds x "
             f"{len(seeds)} seed(s) ({seeds[0]}..{seeds[-1]}), and faulty runs before their "
             f"onset; false alarms: {res['false_alarms']} "
             f"({res['false_alarms_per_step']:.3%} of steps)"]
    for kind, seed, step, ev in res["false_alarm_list"][:15]:
        lines.append(f"  false alarm: {kind} seed {seed} step {step}: {ev}")
    if len(res["false_alarm_list"]) > 15:
        lines.append(f"  ... {len(res['false_alarm_list']) - 15} more")
    lines.append(f"\n{'fault':<28} {'caught':>7} {'delays':>14} {'allowed':>8}  events seen")
    for kind, f in res["faults"].items():
        delays = ",".join("-" if x["delay"] is None else str(x["delay"]) for x in f["runs"])
        seen = sorted({k for x in f["runs"] for k in x["kinds"]})
        lines.append(f"{kind:<28} {f['caught']:>3}/{len(f['runs']):<3} {delays:>14} "
                     f"{f['max_delay']:>8}  {', '.join(seen)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the reduced size CI runs")
    ap.add_argument("--out", default=str(HERE / "results" / "detectors.json"))
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    t0 = time.time()
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    for name, size in ([("quick", QUICK)] if args.quick else
                       [("calibration", FULL), ("second_round", SECOND_ROUND),
                        ("held_out", HELD_OUT)]):
        res = evaluate(size, args.workers)
        print(f"== {name}\n{table(res)}\n")
        out[name] = res
    out["wall_seconds"] = round(time.time() - t0, 1)
    print(f"{out['wall_seconds']} s wall")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    tuned = ["quick"] if args.quick else ["calibration", "second_round"]
    return 0 if all(perfect(out[k]) for k in tuned) else 1


def perfect(res: dict) -> bool:
    """No false alarm, and every fault caught within its allowed delay."""
    return res["false_alarms"] == 0 and all(f["caught"] == len(f["runs"])
                                            for f in res["faults"].values())


if __name__ == "__main__":
    sys.exit(main())
