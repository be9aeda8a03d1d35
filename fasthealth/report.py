"""`fasthealth report LOG_DIR`: plots and a summary from a Monitor's log directory.

Reads ``steps.jsonl`` / ``events.jsonl`` / ``incidents.jsonl`` / ``meta.json`` and writes
``report.html`` (the plots embedded, plus the incident and event tables) and ``report.png`` (the
same plots as one image) into the log directory, and prints a short text summary: the run, its
incidents (one per fault: span, severity, cause, kinds, events, dump), then its events, alarms
and notices counted apart.

What ``fh.replay`` found for an incident's dump (``<dump>.replay.json``, written beside the dump
by the replay) is shown with the incident: reproduced or not, the source, the first module that
made a non-finite value, the samples that alone reproduce it.

A log dir written before incidents existed (no ``incidents.jsonl``) is reported too: its
incidents are taken from the events' ``incident`` field where they have one, else each step
with events is an incident of its own.

Any file content is read without a traceback: a line that cannot be read (not JSON, binary, a
partial last line left by a killed process) is skipped and a value of the wrong kind (a string
where a number goes) is shown as missing, each named on stderr by its file and line number.
Where nothing can be read (no such directory, no steps.jsonl, an empty or unreadable one) the
reason goes to stderr and the exit status is 2.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .monitor.events import ALARM, NOTICE, severity_of
from .monitor.replay import result_path
from .monitor.sinks import json_kind, read_jsonl

EVENT_COLORS = {
    "nonfinite_loss": "#d62728", "nonfinite_grad": "#ff7f0e", "loss_spike": "#9467bd",
    "grad_norm_spike": "#8c564b", "divergence": "#e377c2", "oscillation": "#17becf",
    "vanishing_grad": "#7f7f7f", "optimizer_state_nonfinite": "#bcbd22",
    "loss_scale_collapse": "#1f77b4", "exploding_grad": "#393b79",
    "replica_divergence": "#e7ba52", "lr_jump": "#637939",
}


# The fields of a steps.jsonl record that the report reads, by what they must hold
NUMBERS = ("loss", "grad_norm", "grad_finite_norm", "grad_amax", "nan_count", "inf_count", "lr",
           "loss_scale", "optimizer_nonfinite")
FLAGS = ("grads_finite", "loss_finite", "skipped")
SHOWN = 8  # problems listed one by one; past that, a count
LARGEST = 1e200  # beyond it a log-scale axis overflows (a float32 run's values stay below 1e45)


class LogError(ValueError):
    """Nothing could be read from a log directory: the message says why."""


FILES = ("meta.json", "steps.jsonl", "events.jsonl", "incidents.jsonl")  # the order problems
# are told in
SEVERITIES = (ALARM, NOTICE)
# Incidents drawn on the plots and listed in the summary: alarms in red, notices muted
SPAN_COLORS = {ALARM: "#d62728", NOTICE: "#8c8c8c"}
LABEL_COLORS = {ALARM: "#a01010", NOTICE: "#555555"}
LISTED = 30  # incidents of each severity listed one by one in the summary; past that, a count


@dataclass
class Problems:
    """What was wrong in a log, each as (file, line number or 0, why): ``skipped`` lines
    (unreadable, or with no step number) and ``marked`` values (shown as missing, or listed
    but not plotted)."""

    skipped: list[tuple[str, int, str]] = field(default_factory=list)
    marked: list[tuple[str, int, str]] = field(default_factory=list)

    def text(self, log_dir: str | Path) -> str:
        """The problems for a person, in file and line order, the first few of each kind one
        by one as "FILE line N: why"."""
        out = []
        for items, what in ((self.skipped, "skipped {n} unreadable line(s) in {d}"),
                            (self.marked, "{n} value(s) in {d} are not what a Monitor writes")):
            if not items:
                continue
            out.append("fasthealth report: " + what.format(n=len(items), d=log_dir) + ":")
            ordered = sorted(items, key=lambda p: (FILES.index(p[0]) if p[0] in FILES else 9,
                                                   p[1]))
            out += [f"  {name}{f' line {n}' if n else ''}: {why}"
                    for name, n, why in ordered[:SHOWN]]
            if len(items) > SHOWN:
                out.append(f"  ... and {len(items) - SHOWN} more")
        return "\n".join(out)


def _shown(v) -> str:
    r = json.dumps(v) if not isinstance(v, float) else repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_number(v) -> bool:
    """A JSON number the report can compute with (or null)."""
    if v is None:
        return True
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:  # an integer beyond any float
        return False
    return True


def is_step(v) -> bool:
    """A step number: a JSON integer (not a boolean) that a float holds exactly."""
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= 2**53


def _finite_or_none(v):
    """NaN and Infinity (which Python's json reads, but a Monitor never writes) as null."""
    return v if v is None or math.isfinite(v) else None


def _clean_step(where: tuple[str, int], rec: dict, problems: Problems) -> dict | None:
    """``rec`` with every value the report reads checked: a value of the wrong kind is marked
    and shown as missing; a record with no step number is skipped (None)."""
    if not is_step(rec.get("step")):
        problems.skipped.append((*where, f"'step' is {_shown(rec['step'])}, not a step number"
                                 if "step" in rec else "a record with no 'step'"))
        return None
    out = dict(rec)
    for k in NUMBERS:
        if k in out and not _is_number(out[k]):
            problems.marked.append((*where, f"{k!r} is {_shown(out[k])}, not a number: shown "
                                    "as missing"))
            out[k] = None
        elif k in out and out[k] is not None and abs(out[k]) > LARGEST:
            if math.isfinite(out[k]):
                problems.marked.append((*where, f"{k!r} is {_shown(out[k])}, beyond what the "
                                        f"plots can show ({LARGEST:g}): shown as missing"))
            out[k] = None
        elif k in out and out[k] is not None:
            out[k] = _finite_or_none(float(out[k]))  # counts too: plots take floats
    for k in FLAGS:
        if out.get(k) is not None and not isinstance(out[k], bool):
            problems.marked.append((*where, f"{k!r} is {_shown(out[k])}, not true or false: "
                                    "shown as missing"))
            out[k] = None
    norms = out.get("per_tensor_norms")
    if norms is not None and not isinstance(norms, dict):
        problems.marked.append((*where, f"'per_tensor_norms' is {_shown(norms)}, not an "
                                "object of numbers: shown as missing"))
        out["per_tensor_norms"] = None
    elif norms is not None:
        bad = [k for k, v in norms.items()
               if not _is_number(v) or (v is not None and math.isfinite(v) and abs(v) > LARGEST)]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            problems.marked.append((*where, f"'per_tensor_norms' of {bad[0]!r}{more} is "
                                    f"{_shown(norms[bad[0]])}, not a number: shown as missing"))
        out["per_tensor_norms"] = {k: None if k in bad or v is None
                                   else _finite_or_none(float(v)) for k, v in norms.items()}
    return out


def _clean_event(where: tuple[str, int], rec: dict, problems: Problems) -> dict:
    """``rec`` with the fields the report shows as strings; an event whose step is not a step
    number is listed in the table but not plotted."""
    out = dict(rec)
    if not is_step(out.get("step")):
        problems.marked.append((*where, f"the event's 'step' is {_shown(out.get('step'))}, not "
                                "a step number: listed, not plotted"))
    for k in ("kind", "message"):
        if not isinstance(out.get(k), str):
            problems.marked.append((*where, f"the event's {k!r} is {_shown(out.get(k))}, not a "
                                    "string"))
            out[k] = "?" if out.get(k) is None else json.dumps(out[k])
    if out.get("dump") is not None and not isinstance(out["dump"], str):
        problems.marked.append((*where, f"the event's 'dump' is {_shown(out['dump'])}, not a "
                                "path: shown as missing"))
        out["dump"] = None
    if out.get("severity") not in SEVERITIES:  # a log from before severities: by its kind
        if out.get("severity") is not None:
            problems.marked.append((*where, f"the event's 'severity' is "
                                    f"{_shown(out['severity'])}, not \"alarm\" or \"notice\": "
                                    "taken from its kind"))
        out["severity"] = severity_of(out["kind"])
    if out.get("incident") is not None and not (is_step(out["incident"])
                                                and out["incident"] >= 0):
        problems.marked.append((*where, f"the event's 'incident' is {_shown(out['incident'])}, "
                                "not an incident id: shown as none"))
        out["incident"] = None
    return out


def _clean_incident(where: tuple[str, int], rec: dict, problems: Problems) -> dict | None:
    """An incidents.jsonl record with every field the report reads checked (a value of the
    wrong kind marked, and left to what the events say); None (skipped) for a record that is
    not an incident's or has no id or start step."""
    if rec.get("record", "incident") != "incident":
        problems.skipped.append((*where, f"a {_shown(rec['record'])} record, not an incident's"))
        return None
    for k in ("id", "start"):
        if not (is_step(rec.get(k)) and rec[k] >= 0):
            problems.skipped.append((*where, f"the incident's {k!r} is {_shown(rec[k])}, not "
                                     f"{'an id' if k == 'id' else 'a step number'}"
                                     if k in rec else f"an incident record with no {k!r}"))
            return None

    def check(k, ok, what, default=None):
        if k in rec and rec[k] is not None and not ok(rec[k]):
            problems.marked.append((*where, f"the incident's {k!r} is {_shown(rec[k])}, not "
                                    f"{what}: ignored"))
            return default
        return rec.get(k, default)

    end = check("end", lambda v: is_step(v) and v >= rec["start"], "a step at or after its start")
    out = {"id": rec["id"], "start": rec["start"], "end": rec["start"] if end is None else end,
           "state": check("state", lambda v: v in ("opened", "closed"),
                          "\"opened\" or \"closed\"", "opened") or "opened",
           "kinds": check("kinds", lambda v: isinstance(v, list)
                          and all(isinstance(k, str) for k in v), "a list of kinds"),
           "cause": check("cause", lambda v: isinstance(v, str), "a kind"),
           "severity": check("severity", lambda v: v in SEVERITIES, "\"alarm\" or \"notice\""),
           "events": check("events", lambda v: is_step(v) and v >= 0, "a count"),
           "counts": check("counts", lambda v: isinstance(v, dict) and all(
               isinstance(k, str) and is_step(n) and n >= 0 for k, n in v.items()),
               "steps by kind"),
           "dump": check("dump", lambda v: isinstance(v, str), "a path"),
           "message": check("message", lambda v: isinstance(v, str), "a string"),
           "replay": _replay_of(rec), "logged": True}
    return out


REPLAY_KEYS = ("reproduced", "first_nonfinite", "culprit_ids", "source", "verdict")


def _replay_of(rec: dict) -> dict | None:
    """What replay found, where a record carries it (``reproduced``, ``first_nonfinite``,
    ``culprit_ids``, ``source``, ``verdict``, at its top level or under ``replay``); None when
    it carries none. The Monitor writes none: replay runs after training and writes its result
    beside the dump (``_replay_beside``); a tool that logs its findings can also add them to
    the incident's record."""
    src: dict = rec["replay"] if isinstance(rec.get("replay"), dict) else rec
    found = {k: src[k] for k in REPLAY_KEYS if src.get(k) is not None}
    found = {k: v for k, v in found.items() if isinstance(v, (str, list, int, float))}
    return found or None


def _dump_candidates(dump: str, log_dir: str | Path | None) -> list[Path]:
    """Where a dump may be: its path as logged, under the log_dir, or in the log_dir's dumps/
    (a log_dir that was moved)."""
    p = Path(dump)
    if log_dir is None:
        return [p]
    d = Path(log_dir)
    return [p, d / p, d / "dumps" / p.name]


def _replay_beside(dump: str, log_dir: str | Path, problems: Problems) -> dict | None:
    """What ``fh.replay`` wrote beside ``dump`` (``<dump>.replay.json``), read like the logs:
    None when there is none; an unreadable one is named in ``problems``."""
    for cand in _dump_candidates(dump, log_dir):
        path = result_path(cand)
        try:
            if not path.is_file():
                continue
            rec = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            problems.skipped.append((path.name, 0, f"cannot be read ({exc}): ignored"))
            return None
        if not isinstance(rec, dict):
            problems.skipped.append((path.name, 0, f"{json_kind(rec)}, not an object: ignored"))
            return None
        return _replay_of(rec)
    return None


def _read_meta(path: Path, problems: Problems) -> dict:
    """meta.json's fields that the report reads (names, per_tensor_every, max_grad_norm), each
    checked; {} when there is none or it cannot be read (the plots do without)."""
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        problems.skipped.append((path.name, 0, f"cannot be read ({exc}): ignored"))
        return {}
    if not isinstance(meta, dict):
        problems.skipped.append((path.name, 0, f"{json_kind(meta)}, not an object: ignored"))
        return {}
    checks = {"names": lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
              "per_tensor_every": lambda v: is_step(v) and v >= 1,
              "max_grad_norm": lambda v: _is_number(v) and (v is None or 0 < v < math.inf)}
    for k, ok in checks.items():
        if k in meta and not ok(meta[k]):
            problems.marked.append((path.name, 0, f"{k!r} is {_shown(meta[k])}: ignored"))
            del meta[k]
    return meta


def _records(path: Path, problems: Problems) -> list[tuple[tuple[str, int], dict]]:
    """((file name, line number), record) of every JSON object in ``path``; its unreadable
    lines go to ``problems``. Raises LogError when the file cannot be read at all."""
    try:
        records, bad = read_jsonl(path)
    except OSError as exc:
        raise LogError(f"fasthealth report: cannot read {path}: {exc.strerror or exc}") from exc
    problems.skipped += [(path.name, n, why) for n, why in bad]
    return [((path.name, n), rec) for n, rec in records]


@dataclass
class Log:
    """What ``read_log`` found in a log_dir: every value checked, and ``problems``."""

    meta: dict
    steps: list[dict]
    events: list[dict]
    incidents: list[dict]
    problems: Problems


def read_log(log_dir: str | Path) -> Log:
    """meta.json, steps.jsonl, events.jsonl and incidents.jsonl of a Monitor's log_dir, every
    value checked, and what was wrong (``Problems``). Without incidents.jsonl (a log from
    before incidents) the incidents come from the events (``incidents_of``). Raises
    FileNotFoundError (no such directory, no steps.jsonl), NotADirectoryError, or LogError
    (steps.jsonl unreadable, empty, or without a single readable step): there is nothing to
    report."""
    d = Path(log_dir)
    if not d.exists():
        raise FileNotFoundError(f"fasthealth report: {d} not found (no such directory)")
    if not d.is_dir():
        raise NotADirectoryError(f"fasthealth report: {d} is not a directory: give the log_dir "
                                 "a Monitor wrote (Monitor(..., log_dir=...))")
    steps_path = d / "steps.jsonl"
    if not steps_path.is_file():
        raise FileNotFoundError(f"fasthealth report: {steps_path} not found: is {d} a Monitor's "
                                "log_dir? (a Monitor given log_dir= writes steps.jsonl, "
                                "events.jsonl and meta.json there)")
    problems = Problems()
    meta = _read_meta(d / "meta.json", problems)
    raw = _records(steps_path, problems)
    steps = [r for r in (_clean_step(w, rec, problems) for w, rec in raw) if r is not None]
    if not steps:
        if not raw and not any(f == steps_path.name for f, _, _ in problems.skipped):
            raise LogError(f"fasthealth report: {steps_path} is empty: no step was logged")
        raise LogError(f"fasthealth report: no line of {steps_path} is a step record\n"
                       + problems.text(d))
    events_path = d / "events.jsonl"
    events = [] if not events_path.exists() else [
        _clean_event(w, rec, problems) for w, rec in _records(events_path, problems)]
    records = None
    inc_path = d / "incidents.jsonl"
    if inc_path.exists():
        try:
            raw_inc = _records(inc_path, problems)
        except LogError as exc:  # the events still say what the incidents were
            problems.skipped.append((inc_path.name, 0, f"{str(exc).split(': ', 2)[-1]}: "
                                     "incidents taken from the events"))
        else:
            records = [r for r in (_clean_incident(w, rec, problems) for w, rec in raw_inc)
                       if r is not None]
    incidents = incidents_of(events, records)
    for inc in incidents:
        if inc.get("dump") and not inc.get("replay"):
            inc["replay"] = _replay_beside(inc["dump"], d, problems)
    return Log(meta, steps, events, incidents, problems)


def read(log_dir: str | Path) -> tuple[dict, list[dict], list[dict], Problems]:
    """meta.json, steps.jsonl and events.jsonl of a Monitor's log_dir and the problems found
    (``read_log`` without the incidents)."""
    log = read_log(log_dir)
    return log.meta, log.steps, log.events, log.problems


def load(log_dir: str | Path) -> tuple[dict, list[dict], list[dict]]:
    """meta.json, steps.jsonl and events.jsonl of a Monitor's log_dir (see ``read``); what was
    skipped or marked (a partial last line, a corrupt one, a value of the wrong kind, each
    with its file and line number) is warned."""
    meta, steps, events, problems = read(log_dir)
    if problems.skipped or problems.marked:
        warnings.warn(problems.text(log_dir), RuntimeWarning, stacklevel=2)
    return meta, steps, events


def _severe(events: list[dict]) -> list[dict]:
    """``events`` each with a severity (by its kind where it has none: an older log, or
    events not read by ``read``)."""
    return [e if e.get("severity") in SEVERITIES else dict(e, severity=severity_of(str(
        e.get("kind")))) for e in events]


def _from_events(evs: list[dict], id_: int) -> dict:
    """An incident put together from its events (which have step numbers)."""
    kinds = list(dict.fromkeys(e["kind"] for e in evs))
    alarms = [e for e in evs if e["severity"] == ALARM]
    first = (alarms or evs)[0]
    dump = next((e["dump"] for e in alarms + evs if e.get("dump")), None)
    steps = [e["step"] for e in evs]
    return {"id": id_, "start": min(steps), "end": max(steps), "state": "closed",
            "kinds": kinds, "cause": first["kind"], "severity": ALARM if alarms else NOTICE,
            "events": len(evs), "dump": dump, "message": first.get("message"),
            "replay": next((r for r in map(_replay_of, evs) if r), None), "logged": False}


def incidents_of(events: list[dict], records: list[dict] | None = None) -> list[dict]:
    """The incidents of a log, in order of their start: from incidents.jsonl's ``records``
    (checked by ``_clean_incident``), the latest state of each kept (a closed record overrides
    the opened one), and, for events whose incident has no record (or without
    incidents.jsonl), from the events: by their ``incident`` field where they have one, else
    one incident per step with events. A field a record lacks is filled in from its events.

    An incident is keyed by id and start: a reopened log_dir numbers its incidents from 0
    again, and an incident's start never changes."""
    events = _severe([e for e in events if is_step(e.get("step"))])
    by_key: dict[tuple[int, int], dict] = {}
    for r in records or []:
        key = (r["id"], r["start"])
        if key in by_key and by_key[key]["state"] == "closed" and r["state"] == "opened":
            continue  # a closed incident is not reopened
        by_key[key] = dict(r)
    # each event to the logged incident of its id that started last at or before its step
    starts: dict[int, list[int]] = {}
    for i, s in sorted(by_key):
        starts.setdefault(i, []).append(s)
    members: dict[tuple[int, int], list[dict]] = {k: [] for k in by_key}
    loose: dict[int, list[dict]] = {}  # events of ids with no record, by id
    unfiled: list[dict] = []  # events with no incident id
    for e in events:
        inc_id = e.get("incident")
        if inc_id is None:
            unfiled.append(e)
            continue
        before = [s for s in starts.get(inc_id, []) if s <= e["step"]]
        if before:
            members[(inc_id, before[-1])].append(e)
        else:
            loose.setdefault(inc_id, []).append(e)
    out = []
    for key, r in by_key.items():
        evs = members[key]
        if evs:  # what the record does not say (or an open one has not said yet)
            made = _from_events(evs, r["id"])
            if r["state"] == "opened":
                r["end"] = max(r["end"], made["end"])
            for k in ("kinds", "cause", "severity", "dump", "message", "replay"):
                if r.get(k) is None:
                    r[k] = made[k]
            if r.get("events") is None or r["state"] == "opened":
                r["events"] = max(r.get("events") or 0, len(evs))
        r["kinds"] = r.get("kinds") or []
        r["cause"] = r.get("cause") or (r["kinds"][0] if r["kinds"] else "?")
        r["severity"] = r.get("severity") or (
            ALARM if any(severity_of(k) == ALARM for k in r["kinds"]) else NOTICE)
        r["events"] = r.get("events") or 0
        out.append(r)
    out += [_from_events(evs, i) for i, evs in loose.items()]
    next_id = max([r["id"] for r in out] + [-1]) + 1
    at: dict[int, list[dict]] = {}
    for e in unfiled:
        at.setdefault(e["step"], []).append(e)
    for n, at_step in enumerate(sorted(at)):
        out.append(_from_events(at[at_step], next_id + n))
    return sorted(out, key=lambda r: (r["start"], r["id"]))


def _num(v) -> float:
    return float(v) if v is not None else math.nan


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _dump_shown(dump: str, log_dir: str | Path | None) -> tuple[str, bool]:
    """The dump's path as the summary shows it (under the log_dir: relative to it) and whether
    the file is there (also when the log_dir was moved: then it is in its dumps/)."""
    if log_dir is None:
        return dump, Path(dump).exists()
    d = Path(log_dir)
    for cand in _dump_candidates(dump, log_dir):
        try:
            if cand.exists():
                try:
                    return str(cand.resolve().relative_to(d.resolve())), True
                except ValueError:
                    return str(cand), True
        except OSError:
            continue
    return dump, False


def _replay_line(inc: dict, log_dir: str | Path | None) -> str | None:
    """What the summary says under an incident about its dump and what replay found."""
    if not inc.get("dump"):
        return None  # (a notice's, or dumps="none", or a log without dumps)
    path, there = _dump_shown(inc["dump"], log_dir)
    if not there:
        return f"dump {path} (the file is missing)"
    r = inc.get("replay")
    if not r:
        return (f"dump {path} (not replayed: run fh.replay(dump, model, loss_fn) for the "
                "first bad module and samples)")
    found = []
    if r.get("reproduced") is not None:
        found.append("reproduces" if r["reproduced"] else
                     "does not reproduce (a transient fault, not this batch)")
    if r.get("first_nonfinite"):
        found.append(f"first non-finite module {r['first_nonfinite']}")
    if r.get("source"):
        found.append(f"source {r['source']}")
    if r.get("culprit_ids") is not None:
        ids = r["culprit_ids"] if isinstance(r["culprit_ids"], list) else [r["culprit_ids"]]
        found.append("samples " + ", ".join(map(str, ids[:10]))
                     + (f" (and {len(ids) - 10} more)" if len(ids) > 10 else ""))
    if r.get("verdict") and not found:
        found.append(str(r["verdict"]))
    return f"dump {path}; replay: " + "; ".join(found)


def replay_brief(r: dict | None) -> str | None:
    """What replay found, in a few words for a plot label: the samples, else the first module,
    else the source, else "transient"; None when not replayed."""
    if not r:
        return None
    if r.get("reproduced") is False:
        return "transient"
    ids = r.get("culprit_ids")
    if isinstance(ids, list) and ids:
        return "samples " + ",".join(map(str, ids[:3])) + (" ..." if len(ids) > 3 else "")
    if r.get("first_nonfinite"):
        return str(r["first_nonfinite"])
    if r.get("source"):
        return f"source {r['source']}"
    return "reproduces" if r.get("reproduced") else None


def _with_counts(kinds: list[str], counts: dict | None) -> list[str]:
    """Each kind, with the number of steps it was seen at when more than one (an incident
    records the first event of a kind and counts its repeats)."""
    counts = counts or {}
    return [f"{k} x{counts[k]}" if counts.get(k, 1) > 1 else k for k in kinds]


def _kinds_shown(kinds: list[str], width: int = 60) -> str:
    shown = ", ".join(kinds)
    if len(shown) <= width:
        return shown
    out: list[str] = []
    for k in kinds:
        if len(", ".join(out + [k])) > width - 18:
            break
        out.append(k)
    return ", ".join(out) + f", ... ({len(kinds)} kinds)"


def incident_table(incidents: list[dict], log_dir: str | Path | None = None) -> list[str]:
    """The summary's lines on incidents: a count by severity, then a table of them (alarms,
    then notices, each in order of their start, the first LISTED of each one by one)."""
    alarms = [i for i in incidents if i["severity"] == ALARM]
    notices = [i for i in incidents if i["severity"] != ALARM]
    if not incidents:
        return ["  incidents: none"]
    lines = [f"  incidents: {len(incidents)} ({_plural(len(alarms), 'alarm')}, "
             f"{_plural(len(notices), 'notice')})",
             f"    {'id':<5} {'steps':<13} {'severity':<9} {'events':>6}  {'cause':<26} kinds"]
    for group in (alarms, notices):
        for inc in group[:LISTED]:
            span = f"{inc['start']}-{inc['end']}" + (" open" if inc["state"] != "closed"
                                                    else "")
            kinds = _kinds_shown(_with_counts(inc["kinds"], inc.get("counts")))
            lines.append(f"    {'#' + str(inc['id']):<5} {span:<13} {inc['severity']:<9} "
                         f"{inc['events']:>6}  {inc['cause']:<26} {kinds}")
            more = _replay_line(inc, log_dir)
            if more:
                lines.append(f"          {more}")
        if len(group) > LISTED:
            lines.append(f"    ... and {len(group) - LISTED} more {group[0]['severity']} "
                         "incidents")
    if any(i["state"] != "closed" for i in incidents):
        lines.append("    (open: the log ends before the incident closed, as when the run "
                     "was killed)")
    return lines


def summary(meta: dict, steps: list[dict], events: list[dict],
            incidents: list[dict] | None = None, log_dir: str | Path | None = None) -> str:
    """The text summary: the run, its incidents (``incidents_of(events)`` when not given),
    its events, alarms then notices. ``log_dir``: where the dumps' paths are shown from."""
    if not steps:
        return "fasthealth report: no steps logged"
    events = _severe(events)
    if incidents is None:
        incidents = incidents_of(events)
    losses = [_num(r.get("loss")) for r in steps]
    finite = [v for v in losses if math.isfinite(v)]
    lines = [f"fasthealth report: steps {steps[0]['step']}..{steps[-1]['step']} "
             f"({len(steps)} logged)"]
    if finite:
        lines.append(f"  loss: first {finite[0]:.4g}, last {finite[-1]:.4g}, "
                     f"min {min(finite):.4g}, max {max(finite):.4g}")
    bad = [r["step"] for r in steps
           if r.get("loss_finite") is False or r.get("grads_finite") is False]
    skipped = [r["step"] for r in steps if r.get("skipped")]
    lines.append(f"  non-finite steps: {len(bad)}" + (f" (first at {bad[0]})" if bad else "")
                 + f"; skipped steps: {len(skipped)}")
    norms = [_num(r.get("grad_norm")) for r in steps if math.isfinite(_num(r.get("grad_norm")))]
    if norms:
        lines.append(f"  global grad norm: median {sorted(norms)[len(norms) // 2]:.4g}, "
                     f"max {max(norms):.4g}")
    lines += incident_table(incidents, log_dir)
    if not events:
        lines.append("  events: none")
        return "\n".join(lines)
    n_alarms = sum(e["severity"] == ALARM for e in events)
    lines.append(f"  events: {len(events)} ({_plural(n_alarms, 'alarm')}, "
                 f"{_plural(len(events) - n_alarms, 'notice')})")
    for sev in SEVERITIES:
        counts = Counter(e["kind"] for e in events if e["severity"] == sev)
        if not counts:
            continue
        lines.append(f"    {sev}s:")
        for kind, n in counts.most_common():
            first = min((e["step"] for e in events if e["kind"] == kind and e["severity"] == sev
                         and is_step(e["step"])), default="?")
            lines.append(f"      {kind:<26} {n:>4}  (first at step {first})")
    return "\n".join(lines)


# Rows of marks along the bottom of a panel, in axes coordinates (inside the axes whatever the
# scale): what happened at a step, where a log scale has no zero to put it at.
MARKS = {"nonfinite_grad": (0.05, "#d62728", "|", "non-finite gradients"),
         "nonfinite_loss": (0.12, "black", "x", "non-finite loss"),
         "skipped": (0.19, "green", "|", "skipped step")}


def _marks(ax, steps: list[dict]) -> None:
    """Marks the steps with non-finite gradients, a non-finite loss, or a skip."""
    rows = {"nonfinite_grad": [r["step"] for r in steps if r.get("grads_finite") is False],
            "nonfinite_loss": [r["step"] for r in steps if r.get("loss_finite") is False],
            "skipped": [r["step"] for r in steps if r.get("skipped")]}
    for key, xs in rows.items():
        if xs:
            y, color, marker, label = MARKS[key]
            ax.scatter(xs, [y] * len(xs), transform=ax.get_xaxis_transform(), color=color,
                       marker=marker, s=60, zorder=4, label=label, clip_on=False)


def _legend(ax, extra: list | None = None) -> None:
    """The legend outside the axes, on the right: it hides no data. ``extra``: handles drawn
    after the first (the curve's)."""
    handles, labels = ax.get_legend_handles_labels()
    if extra:
        handles = handles[:1] + extra + handles[1:]
        labels = labels[:1] + [h.get_label() for h in extra] + labels[1:]
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0)


MIN_DRAWN = 1 / 300  # of the x range: the narrowest span or heatmap column drawn (~2 pixels)


def _min_width(xs: list[int]) -> float:
    """The narrowest a one-step span or column is drawn, in steps: a step is under a pixel
    wide in a long run, and a one-step incident or spike must still show."""
    return (max(xs) - min(xs) + 2) * MIN_DRAWN if xs else 1.0


def span_extents(incidents: list[dict], xs: list[int], severity: str) -> list[tuple[float, float]]:
    """The x extents of the spans drawn for the incidents of ``severity``: from half a step
    before the start to half a step after the end, at least ``_min_width``, those that then
    touch merged."""
    w = _min_width(xs)
    out: list[list[float]] = []
    for inc in sorted((i for i in incidents if i["severity"] == severity),
                      key=lambda i: i["start"]):
        x0 = inc["start"] - 0.5
        x1 = max(inc["end"] + 0.5, x0 + w)
        if out and x0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], x1)
        else:
            out.append([x0, x1])
    return [(a, b) for a, b in out]


def _spans(ax, incidents: list[dict], xs: list[int]) -> None:
    """Each incident shaded from its start to its end step, with a line where it began: alarms
    red, notices gray. One collection per severity (thousands of incidents draw quickly)."""
    from matplotlib.collections import LineCollection, PolyCollection  # optional, as every
    # plotting import here

    for sev in SEVERITIES:
        spans = span_extents(incidents, xs, sev)
        if not spans:
            continue
        tr = ax.get_xaxis_transform()  # x in steps, y from the bottom (0) to the top (1)
        ax.add_collection(PolyCollection(
            [[(a, 0), (b, 0), (b, 1), (a, 1)] for a, b in spans], transform=tr, zorder=0,
            facecolors=SPAN_COLORS[sev], edgecolors="none", alpha=0.16 if sev == ALARM else 0.14,
            label=f"_{sev} incidents"), autolim=False)
        starts = sorted({i["start"] - 0.5 for i in incidents if i["severity"] == sev})
        ax.add_collection(LineCollection(
            [[(x, 0), (x, 1)] for x in starts], transform=tr, colors=SPAN_COLORS[sev], lw=0.8,
            alpha=0.7, zorder=0, label=f"_{sev} incident starts"), autolim=False)


def _span_handles(incidents: list[dict]) -> list:
    from matplotlib.patches import Patch  # optional, as every plotting import here

    return [Patch(color=SPAN_COLORS[sev], alpha=0.3, label=f"{sev} incident")
            for sev in SEVERITIES if any(i["severity"] == sev for i in incidents)]


def _loss_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                incidents: list[dict]) -> None:
    """The loss curve, incidents shaded behind it, events marked on it (on the top edge where
    the loss is not finite): alarms filled, notices smaller and hollow."""
    loss = [_num(r.get("loss")) for r in steps]
    positive = [v for v in loss if math.isfinite(v) and v > 0]
    use_log = bool(positive) and max(positive) / min(positive) > 50
    ax.plot(xs, [v if (v > 0 or not use_log) else math.nan for v in loss], lw=1, color="black",
            label="loss")
    if use_log:
        ax.set_yscale("log")
    _spans(ax, incidents, xs)
    at = {r["step"]: v for r, v in zip(steps, loss)}
    groups: dict[tuple[str, str], tuple[list, list]] = {}
    for e in events:
        y = at.get(e["step"], math.nan)
        ok = math.isfinite(y) and (y > 0 or not use_log)
        on, edge = groups.setdefault((e["severity"], e["kind"]), ([], []))
        (on if ok else edge).append((e["step"], y if ok else 0.97))
    kinds = _kind_order(events)
    for sev, kind in sorted(groups, key=lambda g: (SEVERITIES.index(g[0]), kinds.index(g[1]))):
        c = EVENT_COLORS.get(kind, "gray")
        style = (dict(s=30, color=c) if sev == ALARM else
                 dict(s=18, facecolors="none", edgecolors=c, linewidths=0.9))
        label: str | None = kind if sev == ALARM else f"{kind} (notice)"
        for pts, tr in zip(groups[(sev, kind)], (ax.transData, ax.get_xaxis_transform())):
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="v", zorder=3,
                           transform=tr, label=label, **style)
                label = None
    _marks(ax, steps)
    ax.set_title("loss" + (" (log scale)" if use_log else "") + ", incidents shaded, events "
                 "marked (alarms filled, notices hollow)")
    _legend(ax, _span_handles(incidents))


def _kind_order(events: list[dict]) -> list[str]:
    kinds = [k for k in EVENT_COLORS if any(e["kind"] == k for e in events)]
    return kinds + sorted({e["kind"] for e in events} - set(kinds))


def _timeline_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                    incidents: list[dict]) -> None:
    """One row of event marks per kind: alarms on top, notices (paler, labelled so) below."""
    order = _kind_order(events)
    rows = sorted({(e["severity"], e["kind"]) for e in events},
                  key=lambda r: (-SEVERITIES.index(r[0]), -order.index(r[1])))
    _spans(ax, incidents, xs)
    for i, (sev, k) in enumerate(rows):
        st = [e["step"] for e in events if e["kind"] == k and e["severity"] == sev]
        ax.scatter(st, [i] * len(st), color=EVENT_COLORS.get(k, "gray"), marker="|",
                   s=120 if sev == ALARM else 70, alpha=1.0 if sev == ALARM else 0.6)
    ax.set_yticks(range(len(rows)), [k if sev == ALARM else f"{k} (notice)" for sev, k in rows],
                  fontsize=7)
    for label, (sev, _) in zip(ax.get_yticklabels(), rows):
        if sev != ALARM:
            label.set_color(LABEL_COLORS[NOTICE])
            label.set_fontstyle("italic")
    ax.set_ylim(-0.7, max(len(rows), 1) - 0.3)
    ax.set_title("events by kind")


def _grad_norm_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                     incidents: list[dict]) -> None:
    gn = [_num(r.get("grad_norm")) for r in steps]
    ax.plot(xs, [v if v > 0 else math.nan for v in gn], lw=1, color="#1f77b4",
            label="global grad norm")
    if meta.get("max_grad_norm"):
        ax.axhline(meta["max_grad_norm"], color="red", ls="--", lw=1, label="max_grad_norm")
    ax.set_yscale("log")
    _spans(ax, incidents, xs)
    _marks(ax, steps)
    ax.set_title("global gradient norm (log scale), incidents shaded")
    _legend(ax, _span_handles(incidents))


def _nonfinite_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                     incidents: list[dict]) -> None:
    """NaN and Inf gradient values per step (log scale: a single value shows); non-finite
    losses and skipped steps marked along the bottom."""
    nan = [r.get("nan_count") or 0 for r in steps]
    inf = [r.get("inf_count") or 0 for r in steps]
    total = [a + b for a, b in zip(nan, inf)]
    ax.bar(xs, nan, color="#d62728", label="NaN gradient values", width=1.0)
    ax.bar(xs, inf, bottom=nan, color="#ff7f0e", label="Inf gradient values", width=1.0)
    ax.set_ylim(0.3, min(max([1, *total]) * 3, 1e300))  # first: all-zero bars draw no warning
    ax.set_yscale("log")
    _marks(ax, steps)
    ax.set_title("non-finite gradient values per step (log scale)")
    _legend(ax)


def layer_of(name: str) -> str:
    """A parameter's layer: its name up to the first number (``transformer.h.3``), or its
    first part (``wte``)."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else name


def _heatmap_rows(names: list[str], limit: int = 40) -> tuple[list[str], list[list[str]]]:
    """Row labels and the tensors each row combines: a row a tensor, or, past ``limit``
    tensors, a row a layer (norms combined as the root of the sum of squares)."""
    if len(names) <= limit:
        return names, [[n] for n in names]
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(layer_of(n), []).append(n)
    return list(groups), list(groups.values())


@dataclass
class Heatmap:
    """The per-tensor heatmap's data: one column per step whose per-tensor norms were recorded
    (``steps``, in order), standing for the steps from there up to ``ends`` (excluded).
    ``values`` (rows x columns) holds log10 of each row's norm (-inf for a zero norm), NaN
    where it is not finite, and ``bad`` marks those. ``quiet``: the column's record was taken
    at the usual cadence, at a step without events."""

    labels: list[str]
    members: list[list[str]]
    steps: list[int]
    ends: list[int]
    values: Any  # numpy arrays (numpy is imported only where the plots are drawn)
    bad: Any
    quiet: list[bool]
    cadence: int

    @property
    def by_layer(self) -> bool:
        return any(len(m) > 1 for m in self.members)


UNRECORDED = "#e0e0e0"  # the heatmap where nothing was recorded
MAX_COLUMNS = 1500  # heatmap columns at most; past that, neighbouring records are combined


def heatmap_data(meta: dict, steps: list[dict], events: Sequence[dict] = (),
                 max_columns: int = MAX_COLUMNS) -> Heatmap:
    """The heatmap of the steps whose per-tensor norms were recorded, and only those: a Monitor
    records them every ``per_tensor_every`` steps and at every step with events. A record taken
    at the cadence, at a quiet step, stands for the steps up to the next record, at most the
    cadence; a record at a step with events (or with a non-finite norm) stands for its own step
    only: the spike it shows is not what the steps after it held, and they were not recorded
    (drawn gray). Past ``max_columns`` records, neighbouring ones are combined (the largest
    norm of each row, non-finite where any is)."""
    import numpy as np  # the plots' dependencies are optional (the report extra)

    eventful = {e["step"] for e in events if is_step(e.get("step"))}
    per = sorted(((r["step"], r["per_tensor_norms"], bool(r.get("events")) or r["step"] in
                   eventful) for r in steps if r.get("per_tensor_norms")), key=lambda p: p[0])
    dedup: dict[int, tuple] = {}
    for p in per:  # a step logged twice (a reopened run): its last record
        dedup[p[0]] = p
    per = list(dedup.values())
    names = meta.get("names") or (list(per[0][1]) if per else [])
    labels, members = _heatmap_rows(names)
    rec = [p[0] for p in per]
    regular = [p[0] for p in per if not p[2]]
    gaps = np.diff(regular) if len(regular) > 1 else np.diff(rec)
    cadence = max(1, int(meta.get("per_tensor_every") or (np.bincount(gaps).argmax()
                                                          if len(gaps) else 1)))
    last = max(r["step"] for r in steps) + 1 if steps else 0
    vals = np.full((len(labels), len(per)), np.nan)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for k, (_, norms, _) in enumerate(per):
            for i, m in enumerate(members):
                got = [norms.get(n) for n in m]
                if all(v is not None for v in got):
                    vals[i, k] = math.sqrt(sum(v * v for v in got))
        bad = ~np.isfinite(vals)
        logs = np.where(vals > 0, np.log10(np.where(vals > 0, vals, 1.0)),
                        np.where(vals == 0, -np.inf, np.nan))
    quiet, ends = [], []
    for k, (step, _, had_events) in enumerate(per):
        q = not had_events and not bad[:, k].any()
        nxt = rec[k + 1] if k + 1 < len(rec) else last
        quiet.append(q)
        ends.append(max(step + 1, min(nxt, step + cadence, max(last, step + 1))) if q
                    else step + 1)
    h = Heatmap(labels, members, rec, ends, logs, bad, quiet, cadence)
    return _combined(h, max_columns) if len(rec) > max_columns else h


def _combined(h: Heatmap, max_columns: int) -> Heatmap:
    """``h`` with neighbouring columns combined into at most ``max_columns`` (by step)."""
    import numpy as np  # optional, as above

    lo, hi = h.steps[0], h.ends[-1]
    width = math.ceil((hi - lo) / max_columns)
    groups: dict[int, list[int]] = {}
    for k, s in enumerate(h.steps):
        groups.setdefault((s - lo) // width, []).append(k)
    cols = list(groups.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups stay NaN
        values = np.stack([np.nanmax(h.values[:, c], axis=1) for c in cols], axis=1)
    bad = np.stack([h.bad[:, c].any(axis=1) for c in cols], axis=1)
    values[bad] = np.nan
    return Heatmap(h.labels, h.members, [h.steps[c[0]] for c in cols],
                   [max(h.ends[k] for k in c) for c in cols], values, bad,
                   [all(h.quiet[k] for k in c) for c in cols], h.cadence)


def _color_range(h: Heatmap, incidents: list[dict]) -> tuple[float, float]:
    """The heatmap's colour scale: from the smallest norm to a decade above the run's usual
    largest (the 99th percentile of the quiet records outside incidents), so that a run that
    blew up by 20 decades still shows a one-step spike; larger norms saturate."""
    import numpy as np  # optional, as above

    finite = np.isfinite(h.values)
    if not finite.any():
        return 0.0, 1.0
    lo, top = float(h.values[finite].min()), float(h.values[finite].max())
    order = sorted(incidents, key=lambda i: i["start"])
    starts = np.array([i["start"] for i in order])
    reach = np.maximum.accumulate([i["end"] for i in order]) if order else np.array([])
    at = np.searchsorted(starts, h.steps, side="right") - 1  # the last to start at or before
    inside = [k >= 0 and reach[k] >= s for k, s in zip(at, h.steps)]
    usual = [k for k, (q, x) in enumerate(zip(h.quiet, inside)) if q and not x]
    base = h.values[:, usual][finite[:, usual]] if usual else np.array([])
    hi = top if not base.size else min(top, float(np.percentile(base, 99)) + 1.0)
    return lo, max(hi, lo + 1e-3)


def _heatmap_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                   incidents: list[dict]) -> None:
    """log10 of each tensor's (or layer's) gradient norm, in the recorded steps only
    (``heatmap_data``): gray where nothing was recorded, red where a norm was not finite,
    black where it was zero. A one-step column is drawn at least ``_min_width`` wide (up to
    the next record), or a long run would hide it."""
    import numpy as np  # the plots' dependencies are optional (the report extra)
    from matplotlib import colormaps

    h = heatmap_data(meta, steps, events)
    w = _min_width(xs)
    edges: list[float] = []
    cols: list[int | None] = []  # column k of h, or None for a gap where nothing was recorded
    for k, (s0, e0) in enumerate(zip(h.steps, h.ends)):
        x0 = s0 - 0.5
        if edges and x0 > edges[-1]:
            cols.append(None)
            edges.append(x0)
        elif not edges:
            edges.append(x0)
        start = edges[-1]
        nxt = h.steps[k + 1] - 0.5 if k + 1 < len(h.steps) else math.inf
        end = max(e0 - 0.5, min(start + w, nxt))
        if end <= start:  # a widened column before this one took its place
            continue
        cols.append(k)
        edges.append(end)
    arr = np.full((len(h.labels), len(cols)), np.nan)
    bad = np.zeros(arr.shape, dtype=bool)
    for j, col in enumerate(cols):
        if col is not None:
            arr[:, j], bad[:, j] = h.values[:, col], h.bad[:, col]
    lo, hi = _color_range(h, incidents)
    arr[np.isneginf(arr)] = lo - 1.0  # zero norms: below the scale, drawn black
    cmap = colormaps["viridis"].with_extremes(under="black")
    ax.set_facecolor(UNRECORDED)
    edges_y = np.arange(len(h.labels) + 1) - 0.5
    im = ax.pcolormesh(np.array(edges), edges_y, np.ma.masked_invalid(arr), cmap=cmap, vmin=lo,
                       vmax=hi)
    if bad.any():
        ax.pcolormesh(np.array(edges), edges_y, np.ma.masked_where(~bad, np.ones_like(arr)),
                      cmap=matplotlib_red(), vmin=0, vmax=1)
    ax.invert_yaxis()
    step = max(1, len(h.labels) // 30)
    ax.set_yticks(range(0, len(h.labels), step), h.labels[::step], fontsize=6)
    finite = arr[np.isfinite(arr)]
    over = finite.size and finite.max() > hi
    ax.figure.colorbar(im, cax=ax.inset_axes([1.01, 0.0, 0.015, 1.0]), extend="max" if over
                       else "neither", label="log10 grad norm" + (" (saturated above)" if over
                                                                  else ""))
    what = "layer" if h.by_layer else "tensor"
    ax.set_title(f"per-{what} gradient norm at the recorded steps (log10; gray: not recorded, "
                 "black: zero, red: NaN/Inf)")


def matplotlib_red():
    from matplotlib.colors import ListedColormap  # optional, as every plotting import here

    return ListedColormap(["#d62728"])


def _lr_scale_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                    incidents: list[dict]) -> None:
    lr = [_num(r.get("lr")) for r in steps]
    lines = []
    if any(math.isfinite(v) for v in lr):
        lines += ax.plot(xs, lr, color="#2ca02c", label="learning rate")
        if any(v > 0 for v in lr if math.isfinite(v)):
            ax.set_yscale("log")
        ax.set_ylabel("learning rate (log)")
    scale = [_num(r.get("loss_scale")) for r in steps]
    if any(math.isfinite(v) for v in scale):
        ax2 = ax.twinx() if lines else ax
        lines += ax2.plot(xs, scale, color="#1f77b4", label="loss scale" + (
            " (right)" if ax2 is not ax else ""))
        if any(v > 0 for v in scale if math.isfinite(v)):
            ax2.set_yscale("log")
        ax2.set_ylabel("loss scale (log)")
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.08, 1.0), borderaxespad=0)
    ax.set_title(" and ".join(ln.get_label().split(" (")[0] for ln in lines))


def _has(key: str, steps: list[dict]) -> bool:
    return any(r.get(key) is not None and r.get(key) == r.get(key) for r in steps)


# (panel, relative height, whether there is anything to draw)
PANELS = (
    (_loss_panel, 3, lambda m, s, e: True),
    (_timeline_panel, 1.6, lambda m, s, e: bool(e)),
    (_grad_norm_panel, 2, lambda m, s, e: True),
    (_nonfinite_panel, 2, lambda m, s, e: any(r.get("grads_finite") is False
                                              or r.get("loss_finite") is False for r in s)),
    (_heatmap_panel, 3, lambda m, s, e: any(r.get("per_tensor_norms") for r in s)),
    (_lr_scale_panel, 2, lambda m, s, e: _has("lr", s) or _has("loss_scale", s)),
)


LABELLED = 40  # incidents labelled on the loss panel at most


def _label_incidents(ax, incidents: list[dict], rows: int = 3) -> None:
    """Each incident's id and cause (and what replay found, when it fits) at the top of its
    span, inside the axes (below the edge
    where non-finite losses are marked), in up to ``rows`` rows so that labels do not overlap;
    a label that fits nowhere is shortened to its id, or left out (the summary lists every
    incident). Run once the figure's layout is final: it measures the labels."""
    if len(incidents) > LABELLED:  # labels would only hide the plot: the summary lists them
        ax.set_title(ax.get_title() + f"; {len(incidents)} incidents, too many to label")
        return
    renderer = ax.figure.canvas.get_renderer()
    box_ax = ax.get_window_extent(renderer)
    right: list[float] = [-math.inf] * rows  # where each row's last label ends (pixels)
    x_lo, x_hi = ax.get_xlim()
    for inc in sorted(incidents, key=lambda i: (i["start"], i["id"])):
        if not x_lo <= inc["start"] <= x_hi:
            continue
        end_px = ax.transData.transform((max(inc["end"] + 0.5, inc["start"]), 1))[0]
        if end_px <= min(right) + 8:  # no row has room left (a crowded run): none drawn
            continue
        # from its start rightwards, else (at the right edge) leftwards from its end
        brief = replay_brief(inc.get("replay"))
        texts = ([f"#{inc['id']} {inc['cause']}: {brief}"] if brief else []) + [
            f"#{inc['id']} {inc['cause']}", f"#{inc['id']}"]
        tries = [(text, row, ha) for text in texts for ha in ("left", "right")
                 for row in range(rows)]
        for text, row, ha in tries:
            x = inc["start"] - 0.5 if ha == "left" else max(inc["end"] + 0.5, inc["start"])
            t = ax.text(x, 0.93 - 0.085 * row, text, fontsize=7.5, ha=ha, va="top",
                        transform=ax.get_xaxis_transform(), color=LABEL_COLORS[inc["severity"]],
                        zorder=5, clip_on=True, bbox=dict(boxstyle="square,pad=0.1", fc="white",
                                                          ec="none", alpha=0.75))
            box = t.get_window_extent(renderer)
            if box.x0 > right[row] + 8 and box_ax.x0 <= box.x0 and box.x1 <= box_ax.x1:
                right[row] = box.x1
                break
            t.remove()


def figure(meta: dict, steps: list[dict], events: list[dict],
           incidents: list[dict] | None = None):
    """The report's plots: the panels of PANELS that have something to show, one figure;
    ``incidents`` (``incidents_of(events)`` when not given) shaded and labelled."""
    import matplotlib  # optional: `fasthealth report` without it writes the text summary

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    events = _severe([e for e in events if is_step(e.get("step"))])  # the others: only listed
    if incidents is None:
        incidents = incidents_of(events)
    xs = [r["step"] for r in steps]
    panels = [(p, h) for p, h, show in PANELS if show(meta, steps, events)]
    height = sum(h for _, h in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 1.45 * height + 1), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [h for _, h in panels]})
    for ax, (panel, _) in zip(axes[:, 0], panels):
        panel(ax, meta, steps, events, xs, incidents)
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=True)
    axes[-1, 0].set_xlabel("step")
    if xs:
        axes[0, 0].set_xlim(min(xs) - 1, max(xs) + 1)
    # the same margins for every panel, so that one step is one x position in all of them
    fig.subplots_adjust(left=0.17, right=0.80, top=1 - 0.45 / fig.get_figheight(),
                        bottom=0.5 / fig.get_figheight(), hspace=0.45)
    _label_incidents(axes[0, 0], incidents)
    return fig


def write(log_dir: str | Path, out: str | Path | None = None) -> tuple[Path, str]:
    """Reads ``log_dir`` (``read_log``: problems warned) and writes report.html and report.png
    into ``out`` (default: ``log_dir``); returns report.html's path and the text summary."""
    log = read_log(log_dir)
    if log.problems.skipped or log.problems.marked:
        warnings.warn(log.problems.text(log_dir), RuntimeWarning, stacklevel=2)
    return write_report(log_dir, log.meta, log.steps, log.events, out=out,
                        incidents=log.incidents)


NOTICE_ROW = " style='color:#777'"  # a notice's row in the event table: muted


def _incident_rows(incidents: list[dict], log_dir: str | Path) -> str:
    e = html.escape
    rows = []
    for inc in incidents:
        sev = inc["severity"]
        more = _replay_line(inc, log_dir) or ""
        rows.append(
            f"<tr style='color:{LABEL_COLORS[sev]}'><td>#{e(str(inc['id']))}</td>"
            f"<td>{inc['start']}-{inc['end']}{' (open)' if inc['state'] != 'closed' else ''}"
            f"</td><td>{e(sev)}</td><td>{e(inc['cause'])}</td>"
            f"<td>{e(', '.join(_with_counts(inc['kinds'], inc.get('counts'))))}"
            f"</td><td>{inc['events']}</td><td>{e(more)}</td></tr>")
    return "\n".join(rows)


def write_report(log_dir: str | Path, meta: dict, steps: list[dict], events: list[dict],
                 out: str | Path | None = None, incidents: list[dict] | None = None
                 ) -> tuple[Path, str]:
    """``write`` for a log already read (``incidents``: ``incidents_of(events)`` when not
    given)."""
    events = _severe(events)
    if incidents is None:
        incidents = incidents_of(events)
    text = summary(meta, steps, events, incidents, log_dir)
    out = Path(out) if out is not None else Path(log_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = figure(meta, steps, events, incidents)
    fig.savefig(out / "report.png", dpi=90)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt  # optional, as above; figure() imported it already

    plt.close(fig)
    img = base64.b64encode(buf.getvalue()).decode()
    rows = "\n".join(
        f"<tr{NOTICE_ROW if e['severity'] != ALARM else ''}>"
        f"<td>{html.escape(str(e['step']))}</td>"
        f"<td style='color:{EVENT_COLORS.get(e['kind'], 'gray')}'>"
        f"{html.escape(e['kind'])}</td><td>{html.escape(e['severity'])}</td>"
        f"<td>{'' if e.get('incident') is None else '#' + html.escape(str(e['incident']))}</td>"
        f"<td>{html.escape(e['message'])}</td>"
        f"<td>{html.escape(Path(e['dump']).name) if e.get('dump') else ''}</td></tr>"
        for e in events)
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>fasthealth report: {html.escape(str(log_dir))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}pre{{background:#f6f6f6;padding:1em}}
</style></head><body>
<h1>fasthealth report</h1><p>{html.escape(str(Path(log_dir).resolve()))}</p>
<pre>{html.escape(text)}</pre>
<h2>Incidents</h2><table><tr><th>id</th><th>steps</th><th>severity</th><th>cause</th>
<th>kinds</th><th>events</th><th>dump</th></tr>
{_incident_rows(incidents, log_dir) or '<tr><td colspan=7>none</td></tr>'}</table>
<h2>Events</h2><table><tr><th>step</th><th>kind</th><th>severity</th><th>incident</th>
<th>message</th><th>dump</th></tr>
{rows or '<tr><td colspan=6>none</td></tr>'}</table>
<h2>Plots</h2><img src="data:image/png;base64,{img}" style="max-width:100%">
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path, text


def _nothing_read(log_dir: str, exc: Exception) -> int:
    """Exit status 2, the reason on stderr, one line on stdout where the summary goes."""
    msg = str(exc) if str(exc).startswith("fasthealth") else (
        f"fasthealth report: cannot read {log_dir}: {exc}")
    print(msg, file=sys.stderr)
    print("fasthealth report: no report written: " + msg.splitlines()[0].removeprefix(
        "fasthealth report: "))
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fasthealth report", description=__doc__)
    ap.add_argument("log_dir", help="a Monitor's log_dir")
    ap.add_argument("--out", help="where to write report.html/png (default: LOG_DIR)")
    args = ap.parse_args(argv)
    try:
        log = read_log(args.log_dir)
    except (OSError, LogError) as exc:
        return _nothing_read(args.log_dir, exc)
    meta, steps, events, problems = log.meta, log.steps, log.events, log.problems
    if problems.skipped or problems.marked:
        print(problems.text(args.log_dir), file=sys.stderr)
    try:  # an optional dependency: without it, the text summary only
        import matplotlib  # noqa: F401
    except ImportError:
        print(summary(meta, steps, events, log.incidents, args.log_dir))
        print("fasthealth report: the plots and report.html need matplotlib: "
              "pip install 'fasthealth[report]' (or: pip install matplotlib)", file=sys.stderr)
        return 1
    out = args.out if args.out is not None else args.log_dir
    try:
        path, text = write_report(args.log_dir, meta, steps, events, out=out,
                                  incidents=log.incidents)
    except OSError as exc:
        print(f"fasthealth report: cannot write the report to {out}: {exc}", file=sys.stderr)
        return 1
    print(text)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
