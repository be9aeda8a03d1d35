"""Evaluates the monitor through the real trainers (evaluation/trainers/): healthy runs and planted
faults trained by the Hugging Face Trainer and by Lightning with ``HealthCallback()`` at its
defaults.

    python evaluation/eval_trainers.py                 # the tuning families: ~15 min on 2 cores
    python evaluation/eval_trainers.py --quick         # a smoke run (100 steps, three faults)
    python evaluation/eval_trainers.py --final         # the held-out families too: once, at the end

The split is explicit in each family (``held_out``, evaluation/trainers/corpus.py): the tuning set
holds the families the monitor may be tuned on, including the five that were held out until
the first held-out scoring; the held-out set is five newer families, chosen after that scoring
and never tuned on, to be scored once with ``--final``.

Scores per run (evaluation/trainers/runner.py): a healthy run's alarms (each a false alarm); a
faulted run's ``caught`` (an alarm at or after the fault's step within its delay), its alarm
incidents (1 is right), ``right_cause`` (the cause of the incident that caught it equals the
fault's expected cause); every run's steps recorded without a loss (0 is right); a faulted
run's ``effect_z`` and ``effect_ratio``, how far the fault moved the loss at its step (in noise
units against up to 128 steps before it, and over their median). The log checks compare the
trainer's own logs with and without the callback. Totals per split (tuning, held_out), and
among them ``visible_faulted_runs`` and ``caught_visible``: the faulted runs (and those caught)
whose fault a reader can expect to be seen. An acute data fault (``VISIBLE_IF_MOVED``: a
shuffled or a garbage batch) counts as visible only when it moved the loss at least
``VISIBLE_Z`` noise units (or made it non-finite); every other fault counts as visible.
What a fault did to its run is measured against its healthy twin, the healthy run of the same
family and seed (``harm``: the mean loss just after the fault and at the end of the run, over
the twin's); ``missed`` lists the faulted runs not caught with those figures, so that a miss
reads as what it cost.

Writes bench/results/trainers.json (or --out) under ``--label`` (other labels in the file are
kept: "before" and "after" side by side), with ``final`` saying whether the held-out set ran,
and the figure bench/results/trainers.png (or --figure): one row per run, the fault's step, the
alarms coloured by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite
sys.path.insert(0, str(HERE))

import eval_detectors  # noqa: E402  (the results' key)
from trainers import corpus, faults, figure  # noqa: E402
from trainers.runner import FAMILIES, log_check, run  # noqa: E402


def _init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    import lightning  # noqa: F401  (its loggers get their levels on import)
    import transformers

    transformers.logging.set_verbosity_error()
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric", "fasthealth", "fasthealth.integrations.log"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _do(kind_job: tuple[str, dict]) -> tuple[str, dict]:
    kind, job = kind_job
    return kind, (run(job) if kind == "run" else log_check(job))


def evaluate(families: tuple[str, ...], cfg: dict, workers: int = 2,
             progress: bool = True) -> dict:
    """Runs the jobs of ``families`` under ``cfg``; returns {"runs", "log_checks"} in job
    order."""
    runs, checks = corpus.jobs(families, cfg)
    todo = [("run", j) for j in runs] + [("log", j) for j in checks]
    # the log checks (two trainings each) first, so the pool ends on short jobs
    todo.sort(key=lambda kj: kj[0] != "log")
    out: dict[str, list] = {"run": [None] * len(runs), "log": [None] * len(checks)}
    index = {id(j): i for i, j in enumerate(runs)} | {id(j): i for i, j in enumerate(checks)}
    t0 = time.perf_counter()
    if workers <= 1:
        _init()
        done = (_do(kj) for kj in todo)
        pairs = zip(todo, done)
    else:
        import multiprocessing

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init)
        futures = {pool.submit(_do, kj): kj for kj in todo}
        pairs = ((futures[f], f.result()) for f in as_completed(futures))
    for n, ((kind, job), (_, res)) in enumerate(pairs, 1):
        out[kind][index[id(job)]] = res
        if progress:
            what = "log check" if kind == "log" else (job["fault"] or "healthy")
            mark = res.get("error") or (
                f"identical={res.get('identical')}" if kind == "log" else
                f"alarms={res['n_alarms']}" + (f" caught={res['caught']}" if job.get("fault")
                                               else ""))
            print(f"[{n}/{len(todo)} {time.perf_counter() - t0:6.0f}s] {job['family']} {what} "
                  f"seed {job['seed']}: {mark} ({res['seconds']}s)", flush=True)
    if workers > 1:
        pool.shutdown()
    return {"runs": out["run"], "log_checks": out["log"]}


VISIBLE_IF_MOVED = tuple(n for n in ("shuffled_labels", "garbage_batch") if n in faults.ACUTE)
VISIBLE_Z = 6.0


def visible(r: dict) -> bool:
    """Whether a faulted run's fault could be seen: an acute data fault only when it moved the
    loss at least ``VISIBLE_Z`` noise units at its step (``effect_z``) or made it non-finite;
    any other fault always."""
    if r["fault"] not in VISIBLE_IF_MOVED:
        return True
    if r.get("fault_loss_finite") is False:
        return True
    z = r.get("effect_z")
    return z is not None and z >= VISIBLE_Z


HARM_NEXT = 10  # steps after a fault's step whose mean loss is its short-term harm
HARM_END = 20  # a run's last steps, whose mean loss is a fault's lasting harm


def _mean(xs: list) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


def _rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b - 1, 5)


def harm(runs: list[dict]) -> None:
    """What each fault did to its run, against its healthy twin: the healthy run of the same
    family and seed, which trained on the same data in the same order from the same weights up
    to the fault's step. Adds to each faulted run ``harm_next``, the mean loss over the
    ``HARM_NEXT`` steps after the fault's step over the twin's, minus 1; ``harm_end``, the
    same over the run's last ``HARM_END`` steps (None where no finite loss is left);
    ``twin_identical_before``, whether the two runs' losses agree exactly before the fault's
    step (when not, the twin is no fair reference); and the family's ``seed_gap_end``, how far
    two healthy seeds end apart (|seed 0's last steps over the next seed's, minus 1|): the
    scale a lasting harm compares with. Then drops every run's ``losses``."""
    healthy = {(r["family"], r["seed"]): r.get("losses") for r in runs
               if not r["fault"] and "error" not in r}
    gap: dict[str, float | None] = {}
    for (fam, seed), ls in sorted(healthy.items()):
        if fam in gap or not ls:
            continue
        other = next((v for (f, s), v in sorted(healthy.items()) if f == fam and s != seed
                      and v), None)
        if other is not None:
            a, b = _mean(ls[-HARM_END:]), _mean(other[-HARM_END:])
            g = _rel(a, b)
            gap[fam] = None if g is None else abs(g)
    for r in runs:
        ls = r.get("losses")
        twin = healthy.get((r["family"], r["seed"]))
        if not r["fault"] or "error" in r or r.get("fault_step") is None or not ls or not twin:
            continue
        s, end = r["fault_step"], min(len(ls), len(twin))
        r["twin_identical_before"] = ls[:s] == twin[:s]
        r["harm_next"] = _rel(_mean(ls[s + 1:s + 1 + HARM_NEXT]),
                              _mean(twin[s + 1:s + 1 + HARM_NEXT]))
        r["harm_end"] = _rel(_mean(ls[end - HARM_END:end]), _mean(twin[end - HARM_END:end]))
        r["seed_gap_end"] = gap.get(r["family"])
    for r in runs:
        r.pop("losses", None)


def missed(runs: list[dict]) -> list[dict]:
    """The faulted runs not caught, with how far the fault moved the loss at its step and
    what it did to the run (``harm``)."""
    keys = ("family", "fault", "effect_z", "effect_ratio", "harm_next", "harm_end",
            "seed_gap_end", "twin_identical_before")
    return [{k: r.get(k) for k in keys} for r in runs
            if r["fault"] and "error" not in r and not r["caught"]]


def totals(runs: list[dict], checks: list[dict]) -> dict:
    healthy = [r for r in runs if not r["fault"] and "error" not in r]
    faulted = [r for r in runs if r["fault"] and "error" not in r]
    seen = [r for r in faulted if visible(r)]
    return {
        "runs": len(runs), "errors": sum("error" in r for r in runs),
        "healthy_runs": len(healthy),
        "healthy_runs_with_alarms": sum(r["n_alarms"] > 0 for r in healthy),
        "false_alarms": sum(r["n_alarms"] for r in healthy),
        "faulted_runs": len(faulted), "caught": sum(r["caught"] for r in faulted),
        "one_incident": sum(r["alarm_incidents"] == 1 for r in faulted),
        "right_cause": sum(r["right_cause"] for r in faulted),
        "runs_with_null_loss": sum(r["null_loss_steps"] > 0 for r in healthy + faulted),
        "null_loss_steps": sum(r["null_loss_steps"] for r in healthy + faulted),
        "log_checks": len(checks),
        "log_checks_identical": sum(bool(c.get("identical")) for c in checks),
        "log_check_errors": sum("error" in c for c in checks),
        "visible_faulted_runs": len(seen), "caught_visible": sum(r["caught"] for r in seen),
        "missed": missed(runs),
    }


def table(runs: list[dict], checks: list[dict]) -> str:
    lines = [f"{'family':40s} {'fault':16s} seed  alarms  caught delay  inc cause"
             f"{'':16s} null   kinds (faulted: effect_z)"]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['family']:40s} {r['fault'] or 'healthy':16s} {r['seed']:4d}  "
                         f"ERROR {r['error'][:80]}")
            continue
        kinds = ",".join(sorted({a["kind"] for a in r["alarms"]})) or "-"
        if r["fault"]:
            c = f"{'yes' if r['caught'] else 'NO':6s} {r['delay'] if r['caught'] else '-':>5} "
            c += f"{r['alarm_incidents']:4d} {str(r['cause']):>14s}/{r['expected_cause']:<13s}"
        else:
            c = f"{'':6s} {'':5s} {r['alarm_incidents']:4d} {'':28s}"
        z = r.get("effect_z")
        effect = "" if not r["fault"] else f"  z={'-' if z is None else format(z, '.1f')}"
        if r["fault"] and r.get("harm_next") is not None:
            end = r.get("harm_end")
            effect += (f" harm next {r['harm_next']:+.2%} end "
                       f"{'-' if end is None else format(end, '+.2%')}")
        lines.append(f"{r['family']:40s} {r['fault'] or 'healthy':16s} {r['seed']:4d} "
                     f"{r['n_alarms']:6d}  {c} {r['null_loss_steps']:4d}   {kinds}{effect}")
    for c in checks:
        state = c.get("error") or ("identical" if c["identical"] else c["first_difference"])
        lines.append(f"log check {c['family']}: {state}")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True).stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 100 steps, 3 faults")
    ap.add_argument("--final", action="store_true", help="the held-out families too (once)")
    ap.add_argument("--only", help="comma-separated family names (of the sets being run)")
    ap.add_argument("--faults", help="comma-separated fault names")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seeds", type=int, help="healthy seeds per family")
    ap.add_argument("--label", help="key of the results in --out (default: the date and the "
                    "commit measured; --redraw needs it)")
    ap.add_argument("--note", help="a line kept with the results")
    ap.add_argument("--out", default=str(RESULTS / "trainers.json"))
    ap.add_argument("--figure", default=str(RESULTS / "trainers.png"))
    ap.add_argument("--harm-figure", default=str(RESULTS / "trainers_harm.png"),
                    help="each fault's effect at its step against its lasting harm")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--redraw", action="store_true",
                    help="only draw --figure again from --out's --label (no training)")
    a = ap.parse_args(argv)
    if a.redraw and not a.label:
        ap.error("--redraw draws the entry of --label: give it")
    if a.redraw:
        stored = json.loads(Path(a.out).read_text())[a.label]
        figure.draw(stored["runs"], a.figure, title=f"{a.label} ({', '.join(stored['splits'])}"
                    f"{', quick' if stored['quick'] else ''})")
        if a.harm_figure:
            figure.draw_harm(stored["runs"], a.harm_figure, title=_harm_title(a.label),
                             visible_z=VISIBLE_Z)
        return 0
    cfg = dict(corpus.QUICK if a.quick else corpus.FULL)
    if a.faults:
        cfg["faults"] = tuple(a.faults.split(","))
    if a.steps:
        cfg["steps"] = a.steps
    if a.seeds:
        cfg["seeds"] = tuple(range(a.seeds))
    splits = {"tuning": corpus.TUNING} | ({"held_out": corpus.HELD_OUT} if a.final else {})
    if a.only:
        keep = set(a.only.split(","))
        unknown = keep - set(FAMILIES)
        if unknown:
            ap.error(f"unknown families {sorted(unknown)}")
        splits = {k: tuple(f for f in v if f in keep) for k, v in splits.items()}
    t0 = time.perf_counter()
    families = tuple(f for v in splits.values() for f in v)
    res = evaluate(families, cfg, workers=a.workers)
    harm(res["runs"])
    split_of = {f: k for k, v in splits.items() for f in v}
    result = {
        "final": a.final, "quick": a.quick, "config": {**cfg, "seeds": list(cfg["seeds"])},
        "splits": {k: list(v) for k, v in splits.items()}, "note": a.note,
        "commit": _commit(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "seconds": round(time.perf_counter() - t0, 1),
        "totals": {k: totals([r for r in res["runs"] if split_of[r["family"]] == k],
                             [c for c in res["log_checks"] if split_of[c["family"]] == k])
                   for k in splits},
        "runs": res["runs"], "log_checks": res["log_checks"],
    }
    a.label = eval_detectors.results_key(a.label, a.final, result["commit"])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(out.read_text()) if out.exists() else {}
    stored[a.label] = result
    out.write_text(json.dumps(stored, indent=1, default=str) + "\n")
    print(table(res["runs"], res["log_checks"]))
    print(json.dumps(result["totals"], indent=1))
    if a.figure:
        figure.draw(res["runs"], a.figure, title=f"{a.label} ({', '.join(splits)}"
                    f"{', quick' if a.quick else ''})")
    if a.harm_figure:
        figure.draw_harm(res["runs"], a.harm_figure, title=_harm_title(a.label),
                         visible_z=VISIBLE_Z)
    return 0


def _harm_title(label: str) -> str:
    return (f"{label}: each planted fault, its effect at its step and its lasting harm "
            f"against its healthy twin")


if __name__ == "__main__":
    sys.exit(main())
