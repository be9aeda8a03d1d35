"""The runs of a log directory, for ``fasthealth report`` (``monitor/runs.py`` writes them).

A log directory holds runs ``run-NNN/``; the report shows one (the latest: the one whose last
start, or resume, is the most recent; a run without a readable start time by its number, after
those with one) and lists the others. A directory in the layout from before runs
(``steps.jsonl`` directly in it) is one run, named ``.``; so is a run directory given itself.
A run's abandoned branches (records after the step a resume went back to, written before it:
``monitor.runs.abandoned_lines``) are left out of its summary and plots.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..monitor.runs import abandoned_lines, is_run_name, run_dirs
from ..monitor.sinks import read_jsonl
from .read import Log, LogError, log_directory, read_log

OLD_LAYOUT = "."  # the name of the run of a directory in the layout from before runs


@dataclass
class RunInfo:
    """One run of a log directory: its id, folder and meta.json (or {})."""

    id: str
    dir: Path
    meta: dict

    @property
    def started(self) -> float | None:
        s = self.meta.get("started")
        return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None

    @property
    def last_start(self) -> float | None:
        """The latest of its start and its resumes' starts."""
        times = [self.started] + [r.get("started") for r in self.resumes]
        found = [float(t) for t in times if isinstance(t, (int, float))
                 and not isinstance(t, bool)]
        return max(found) if found else None

    @property
    def resumes(self) -> list[dict]:
        r = self.meta.get("resumes")
        return [x for x in r if isinstance(x, dict)] if isinstance(r, list) else []


def _meta(d: Path) -> dict:
    try:
        if not (d / "meta.json").is_file():  # a FIFO there would block the report
            return {}
        meta = json.loads((d / "meta.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def find_runs(log_dir: Path) -> list[RunInfo]:
    """The runs of ``log_dir``, by number (the old layout's run first)."""
    runs = []
    if (log_dir / "steps.jsonl").is_file():  # the old layout, or a run directory itself
        meta = _meta(log_dir)
        own = str(meta["run"]) if is_run_name(str(meta.get("run"))) else OLD_LAYOUT
        runs.append(RunInfo(own, log_dir, meta))
    return runs + [RunInfo(d.name, d, _meta(d)) for d in run_dirs(log_dir)
                   if (d / "steps.jsonl").is_file()]


def latest(runs: list[RunInfo]) -> RunInfo:
    return max(enumerate(runs), key=lambda ir: (ir[1].last_start is not None,
                                                ir[1].last_start or 0.0, ir[0]))[1]


def choose(log_dir: str | Path, run: str | None) -> tuple[RunInfo, list[RunInfo]]:
    """(the run to report, every run of the directory). Raises FileNotFoundError or
    NotADirectoryError where there is no such directory, LogError where it holds no run or no
    run ``run``."""
    d = log_directory(log_dir)
    runs = find_runs(d)
    if not runs:
        empty = [p.name for p in run_dirs(d)]
        raise FileNotFoundError(
            f"fasthealth report: no run with a steps.jsonl in {d}: is {d} a Monitor's "
            "log_dir? (a Monitor given log_dir= writes each run into LOG_DIR/run-NNN/: "
            "steps.jsonl, events.jsonl, meta.json)"
            + (f"; {', '.join(empty)} logged no step" if empty else ""))
    if run is None:
        return latest(runs), runs
    for r in runs:
        if run in (r.id, r.dir.name) or (run.isdigit() and r.id == f"run-{int(run):03d}"):
            return r, runs
    raise LogError(f"fasthealth report: no run {run!r} in {d} (its runs: "
                   + ", ".join(r.id for r in runs) + ")")


def _when(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def brief(r: RunInfo) -> str:
    """One line on a run: its steps, start and incidents (read quickly, not checked), its
    abandoned branches left out as in its own report."""
    gone = abandoned_lines(r.dir, r.resumes)
    try:
        steps = [rec["step"] for n, rec in read_jsonl(r.dir / "steps.jsonl")[0]
                 if isinstance(rec.get("step"), int) and n not in gone.get("steps.jsonl", ())]
    except OSError:
        steps = []
    try:
        incs = {(rec.get("id"), rec.get("start"))
                for n, rec in read_jsonl(r.dir / "incidents.jsonl")[0]
                if n not in gone.get("incidents.jsonl", ())}
        n_inc = str(len(incs))
    except OSError:
        n_inc = "not recorded"
    span = f"steps {min(steps)}..{max(steps)} ({len(steps)} logged)" if steps else "no steps"
    more = f", resumed {len(r.resumes)}x" if r.resumes else ""
    return f"{r.id:<9} {span:<30} started {_when(r.started)}{more}, incidents {n_inc}"


def read_run(log_dir: str | Path, run: str | None = None) -> tuple[RunInfo, Log]:
    """The chosen run of ``log_dir`` read (``read_log``) with its abandoned branches left
    out, and ``Log.header`` / ``Log.footer`` saying which run it is, what was left out and the
    other runs."""
    chosen, runs = choose(log_dir, run)
    gone = abandoned_lines(chosen.dir, chosen.resumes)
    log = read_log(chosen.dir, skip=gone)
    n_gone = sum(len(v) for v in gone.values())
    if len(runs) > 1 or chosen.id != OLD_LAYOUT:
        which = "the latest" if run is None else "chosen with --run"
        log.header.append(f"fasthealth report: run {chosen.id} of {Path(log_dir)} ({which} "
                          f"of {len(runs)} run{'s' if len(runs) > 1 else ''}; started "
                          f"{_when(chosen.started)})")
    for r in chosen.resumes:
        if r.get("abandons"):
            log.footer.append(f"  resumed from step {r.get('step')} at {_when(r.get('started'))}"
                              f" (the run had reached step {r.get('reached')}): the records "
                              "after that step written before it are an abandoned branch")
        for c in r.get("cut") or []:
            if isinstance(c, dict):
                log.footer.append(f"  {c.get('file')}: a partial last line of {c.get('bytes')} "
                                  "bytes (a killed writer's) was cut at the takeover (kept in "
                                  "meta.json)")
    if n_gone:
        by_file = ", ".join(f"{len(v)} in {k}" for k, v in sorted(gone.items()))
        log.footer.append(f"  abandoned branch: {n_gone} record(s) left out of this summary "
                          f"and the plots ({by_file})")
    others = [r for r in runs if r is not chosen]
    if others:
        log.footer.append(f"  other runs in {Path(log_dir)} (fasthealth report --run ID):")
        log.footer += [f"    {brief(r)}" for r in others]
    return chosen, log


def mark_figure(fig, meta: dict) -> None:
    """The run's id in the figure's corner (``plots.figure`` draws its resumes' lines)."""
    run = meta.get("run")
    if isinstance(run, str):
        fig.text(0.01, 1 - 0.1 / fig.get_figheight(), f"run {run}", fontsize=10, va="top")
