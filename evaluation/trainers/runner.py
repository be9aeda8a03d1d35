"""One run of the trainer evaluation, and its score; the check that the callback leaves the
trainer's own logs alone.

A run is ``(family, fault or None, seed, steps)``. It trains through the family's trainer
(``hf.train`` / ``lit.train``) with ``HealthCallback()`` at its defaults, then reads what the
callback's monitor returns (``callback.monitor.events`` and ``.incidents``) and the
``steps.jsonl`` it wrote, and scores:

- every run: its alarms (``severity == "alarm"`` events: step and kind), its alarm incidents
  (start, end, kinds, ``cause``), the steps whose record has no loss (``loss`` null in
  steps.jsonl while ``loss_finite`` is not false: the callback did not get the loss; should be
  0 everywhere; a non-finite loss, also written null, is counted apart as
  ``nonfinite_loss_steps``) and how many steps were recorded against how many the trainer
  took;
- a healthy run: every alarm is a false alarm;
- a faulted run: ``caught`` (an alarm at or after the fault's step, at most its delay after),
  ``delay`` (the first such alarm's steps after the fault's step), ``alarm_incidents`` (should
  be exactly 1), ``right_cause`` (the ``cause`` of the incident of that first alarm equals the
  fault's expected cause; false when not caught). ``planted`` lists the steps the harness
  planted something at, the harness's own check that the fault went in where it says.

``log_check`` runs a healthy family twice with the same seed, with and without the callback,
and compares the trainer's own record (the HF Trainer's ``state.log_history``, ``logging_steps``
10 so that it has one; for Lightning the harness's per-batch record of the training step's loss,
what the module logged and the learning rate) up to the first step the monitor skipped. Timing
entries (``train_runtime``, ``*_per_second``) are left out; numbers must agree to 1e-6
relative (the monitor's clipping may round differently from the Trainer's) and keys exactly.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from fasthealth.monitor.robust import spike_scores

from . import hf, lit
from .faults import FAULTS, Plan

FAMILIES: dict[str, Any] = {**hf.FAMILIES, **lit.FAMILIES}
TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def _train(family, plan, seed, steps, out_dir, **kw) -> dict:
    mod = hf if family.trainer == "hf" else lit
    return mod.train(family, plan, seed, steps, out_dir, **kw)


def read_steps(log_dir: str) -> list[dict]:
    """The steps.jsonl rows of the latest run in ``log_dir`` (``LOG_DIR/run-NNN/``)."""
    runs = sorted(Path(log_dir).glob("run-[0-9][0-9][0-9]*"), key=lambda p: int(p.name[4:]))
    path = (runs[-1] if runs else Path(log_dir)) / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


EFFECT_WINDOW = 128  # steps before the fault's step whose finite losses are its reference
EFFECT_MIN = 20  # fewer finite losses than this before the fault's step: no effect_z


def fault_effect(rows: list[dict], fault_step: int) -> dict:
    """How far the loss at ``fault_step`` stands from the finite losses of the up to
    ``EFFECT_WINDOW`` steps before it in ``rows`` (steps.jsonl): ``effect_z``, the smaller of
    ``spike_scores`` (noise units), and ``effect_ratio``, the loss over their median; both
    None when fewer than ``EFFECT_MIN`` finite losses precede it or its own loss is not finite
    (``fault_loss_finite`` False: a null loss at the step, or its row says ``loss_finite``
    false; None when no row has the step)."""
    by_step: dict[int, Any] = {}
    for r in rows:
        if r.get("step") is not None:
            by_step[int(r["step"])] = r  # the last row of a step

    def finite(r: dict | None) -> float | None:
        v = None if r is None or r.get("loss_finite") is False else r.get("loss")
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    at = by_step.get(fault_step)
    x = finite(at)
    before = [v for v in (finite(by_step.get(s))
                          for s in range(max(0, fault_step - EFFECT_WINDOW), fault_step))
              if v is not None]
    out: dict[str, Any] = {"effect_z": None, "effect_ratio": None,
                           "fault_loss_finite": None if at is None else x is not None,
                           "effect_reference_steps": len(before)}
    if x is None or len(before) < EFFECT_MIN:
        return out
    z = min(spike_scores(before, x))
    median = statistics.median(before)
    out["effect_z"] = round(z, 3) if math.isfinite(z) else z
    out["effect_ratio"] = round(x / median, 4) if median != 0 else None
    return out


def losses(rows: list[dict], steps: int) -> list[float | None]:
    """The loss of each step 0..steps-1 (the last row of a step), None where it is missing or
    not finite: for the harm of a fault against its healthy twin (eval_trainers.harm), which
    drops it before the results are written."""
    out: list[float | None] = [None] * steps
    for r in rows:
        s, v = r.get("step"), r.get("loss")
        if (isinstance(s, int) and 0 <= s < steps and r.get("loss_finite") is not False
                and isinstance(v, (int, float)) and math.isfinite(v)):
            out[s] = float(v)
    return out


def score(monitor: Any, rows: list[dict], fault_name: str | None, fault_step: int,
          trained_steps: int) -> dict:
    """The score of one run from its monitor (``events``, ``incidents``) and its steps.jsonl
    rows; ``fault_step`` -1 for a healthy run."""
    events = list(getattr(monitor, "events", []) or [])
    incidents = list(getattr(monitor, "incidents", []) or [])
    alarms = [{"step": int(e.step), "kind": e.kind, "incident": getattr(e, "incident", None)}
              for e in events if getattr(e, "severity", "alarm") == "alarm"]
    notices = [{"step": int(e.step), "kind": e.kind} for e in events
               if getattr(e, "severity", "alarm") != "alarm"]
    alarm_incidents = [{"id": i.id, "start": int(i.start), "end": int(i.end),
                        "kinds": list(i.kinds), "cause": getattr(i, "cause", None),
                        "trigger": getattr(i, "trigger", None),
                        "check_first": getattr(i, "check_first", None),
                        "dump": getattr(i, "dump", None)}
                       for i in incidents if getattr(i, "severity", "alarm") == "alarm"]
    out: dict[str, Any] = {
        "alarms": alarms, "n_alarms": len(alarms), "notices": notices,
        "incidents": alarm_incidents, "alarm_incidents": len(alarm_incidents),
        "null_loss_steps": sum(1 for r in rows
                               if r.get("loss") is None and r.get("loss_finite") is not False),
        "nonfinite_loss_steps": sum(1 for r in rows if r.get("loss_finite") is False),
        "recorded_steps": len(rows), "trained_steps": trained_steps,
        "skipped_steps": [int(r["step"]) for r in rows if r.get("skipped")],
        "losses": losses(rows, trained_steps),
    }
    if fault_name is None:
        return out
    fault = FAULTS[fault_name]
    hits = [a for a in alarms if fault_step <= a["step"] <= fault_step + fault.delay]
    first = hits[0] if hits else None
    incident = next((i for i in alarm_incidents if first and i["id"] == first["incident"]), None)
    if first is not None and incident is None:  # an alarm outside any listed incident
        incident = next((i for i in alarm_incidents
                         if i["start"] <= first["step"] <= i["end"]), None)
    out.update({
        "fault_step": fault_step, "max_delay": fault.delay, "expected_cause": fault.cause,
        "caught": first is not None,
        "delay": None if first is None else first["step"] - fault_step,
        "caught_by": None if first is None else first["kind"],
        "cause": None if incident is None else incident["cause"],
        "right_cause": incident is not None and incident["cause"] == fault.cause,
        "dump": None if incident is None else incident["dump"],
        "trigger": None if incident is None else incident["trigger"],
    })
    out.update(fault_effect(rows, fault_step))
    return out


REPLAYED = ("loss_spike", "grad_norm_spike", "nonfinite_loss", "nonfinite_grad", "divergence")


def replay_cause(res: dict, out: dict) -> None:
    """What a user who follows the incident's advice gets: ``fh.replay`` of the caught
    incident's dump, with the trainer's own loss (``out["loss_fn"]``). ``host_cause`` is the
    incident's cause as the monitor named it; ``cause`` and ``right_cause`` become replay's
    where it names one (its verdict uses the dump: the batch, the weights, the rates), for the
    incidents a loss or gradient value opened (``REPLAYED``): those whose cause the monitor
    can only guess from how the loss went on, and whose advice is to replay. An incident
    opened by direct evidence (a weight scan, a repeated batch, a rate no schedule explains,
    broken optimizer state, the loss scale) keeps the monitor's cause."""
    res["host_cause"], res["host_right_cause"] = res.get("cause"), res.get("right_cause")
    dump = res.pop("dump", None)
    if (not res.get("caught") or not dump or out.get("loss_fn") is None
            or res.get("trigger") not in REPLAYED):
        return
    import fasthealth as fh

    model = out["model"]
    if getattr(model, "_trainer", None) is not None:  # a LightningModule: copied without it
        model._trainer = None
    try:
        r = fh.replay(dump, model, out["loss_fn"], save=False)
    except Exception as exc:  # a replay that fails is a result too: the host cause stands
        res["replay_error"] = f"{type(exc).__name__}: {exc}"
        return
    res["replay_cause"], res["replay_verdict"] = r.cause, r.verdict[:400]
    if r.cause is not None:
        res["cause"] = r.cause
        res["right_cause"] = r.cause == res["expected_cause"]


def run(job: dict) -> dict:
    """``job``: family, fault (None: healthy), seed, steps. Returns the job with its score, or
    with ``error`` when the run raised."""
    family = FAMILIES[job["family"]]
    fault = FAULTS[job["fault"]] if job.get("fault") else None
    res: dict[str, Any] = {**job, "trainer": family.trainer, "held_out": family.held_out}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="fh-eval-") as tmp:
            plan = Plan(fault, job["steps"], job["seed"])
            out = _train(family, plan, job["seed"], job["steps"], tmp)
            rows = read_steps(out["log_dir"])
            res.update(score(out["callback"].monitor, rows, job.get("fault"), plan.step,
                             out["steps"]))
            if job.get("fault"):
                replay_cause(res, out)
            res.pop("dump", None)
            res.update(planted=plan.planted[:5], hit=plan.hit)
    except Exception as exc:  # a run that breaks is a result too
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc(limit=8)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _clean(log: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in log]


def compare_logs(a: list[dict], b: list[dict], before: float = math.inf,
                 rtol: float = 1e-6) -> dict:
    """Compares two trainer records row by row up to (not including) step ``before``: the
    keys each row has, and its numbers to ``rtol``. Returns identical (bool), exact (bool),
    the rows compared, the first difference and the largest relative difference."""
    a = [r for r in _clean(a) if r.get("step", -1) < before]
    b = [r for r in _clean(b) if r.get("step", -1) < before]
    first, worst, exact = None, 0.0, True
    if len(a) != len(b):
        first = f"{len(a)} rows with the callback, {len(b)} without"
    for i, (x, y) in enumerate(zip(a, b)):
        if set(x) != set(y):
            first = first or (f"row {i} (step {x.get('step')}): keys only with the callback "
                              f"{sorted(set(x) - set(y))}, only without {sorted(set(y) - set(x))}")
        for k in set(x) & set(y):
            u, v = x[k], y[k]
            if u == v:
                continue
            exact = False
            if isinstance(u, (int, float)) and isinstance(v, (int, float)):
                rel = abs(u - v) / max(abs(v), 1e-12)
                worst = max(worst, rel)
                if rel > rtol:
                    first = first or f"row {i} (step {x.get('step')}): {k} {u!r} != {v!r}"
            else:
                first = first or f"row {i} (step {x.get('step')}): {k} {u!r} != {v!r}"
    return {"identical": first is None, "exact": exact and first is None, "rows": len(a),
            "first_difference": first, "max_rel_diff": worst}


def log_check(job: dict) -> dict:
    """The trainer's own record with and without the callback (one healthy family, one seed;
    ``job["callbacks"]``, default (True, False), says which two runs are compared)."""
    family = FAMILIES[job["family"]]
    res: dict[str, Any] = {**job, "trainer": family.trainer, "held_out": family.held_out}
    t0 = time.perf_counter()
    try:
        logs = []
        skipped: list[int] = []
        for callback in job.get("callbacks", (True, False)):
            with tempfile.TemporaryDirectory(prefix="fh-eval-") as tmp:
                out = _train(family, None, job["seed"], job["steps"], tmp, callback=callback,
                             logging_steps=10)
                logs.append(out["log"])
                if callback:
                    skipped = [int(r["step"]) for r in read_steps(out["log_dir"])
                               if r.get("skipped")]
        before = min(skipped) if skipped else math.inf
        res.update(compare_logs(logs[0], logs[1], before))
        res["first_skipped"] = None if not skipped else before
        res["with_callback"] = _clean(logs[0])[:3]
        res["without_callback"] = _clean(logs[1])[:3]
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc(limit=8)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res
