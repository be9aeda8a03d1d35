"""The tolerant reader of a Monitor's log directory: every record checked, and what was wrong
with it told by file and line (``Problems``) instead of a traceback.

Reads ``meta.json``, ``steps.jsonl``, ``events.jsonl`` and ``incidents.jsonl``; a line that
cannot be read (not JSON, binary, a partial last line left by a killed process, a record with
no step) is skipped and a value of the wrong kind (a string where a number goes) is shown as
missing. The step fields are checked by the types ``monitor/schema.py`` declares for them.
What ``fh.replay`` wrote beside an incident's dump (``<dump>.replay.json``) is read with the
incident. The incidents are incidents.jsonl's: a log without one has none.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..monitor import kinds, schema
from ..monitor.causes import CHECK_FIRST, DEFAULT, DIRECT, RECOVERY
from ..monitor.kinds import ALARM, SEVERITIES
from ..monitor.replay import result_path
from ..monitor.sinks import json_kind, read_jsonl

BASES = (DIRECT, RECOVERY, DEFAULT)  # what named an incident's cause (Incident.basis)

# The fields of a steps.jsonl record checked, by the type the schema gives them: numbers (a
# count too: the plots take floats) and flags (null allowed: shown as missing)
NUMBERS = schema.of_type(schema.FLOAT, schema.COUNT)
FLAGS = schema.of_type(schema.FLAG, schema.MAYBE_FLAG)
SHOWN = 8  # problems listed one by one; past that, a count
LARGEST = 1e200  # beyond it a log-scale axis overflows (a float32 run's values stay below 1e45)


class LogError(ValueError):
    """Nothing could be read from a log directory: the message says why."""


FILES = ("meta.json", "steps.jsonl", "events.jsonl", "incidents.jsonl")  # the order problems
# are told in


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


def as_float(v) -> float:
    """A checked value as the summary and the plots compute with it: NaN where it is missing."""
    return float(v) if v is not None else math.nan


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
    if "step" not in out:
        problems.marked.append((*where, "an event with no 'step': listed, not plotted"))
        out["step"] = None
    elif not is_step(out["step"]):
        problems.marked.append((*where, f"the event's 'step' is {_shown(out['step'])}, not "
                                "a step number: listed, not plotted"))
    for k in ("kind", "message"):
        if not isinstance(out.get(k), str):
            problems.marked.append((*where, f"the event's {k!r} is {_shown(out[k])}, not a "
                                    "string" if k in out else f"an event with no {k!r}"))
            out[k] = "?" if out.get(k) is None else json.dumps(out[k])
    if out.get("dump") is not None and not isinstance(out["dump"], str):
        problems.marked.append((*where, f"the event's 'dump' is {_shown(out['dump'])}, not a "
                                "path: shown as missing"))
        out["dump"] = None
    if out.get("severity") not in SEVERITIES:  # none (a log from before severities): by kind
        if out.get("severity") is not None:
            problems.marked.append((*where, f"the event's 'severity' is "
                                    f"{_shown(out['severity'])}, not \"alarm\" or \"notice\": "
                                    "taken from its kind"))
        out["severity"] = kinds.severity_of(out["kind"])
    if out.get("incident") is not None and not (is_step(out["incident"])
                                                and out["incident"] >= 0):
        problems.marked.append((*where, f"the event's 'incident' is {_shown(out['incident'])}, "
                                "not an incident id: shown as none"))
        out["incident"] = None
    return out


def _clean_incident(where: tuple[str, int], rec: dict, problems: Problems) -> dict | None:
    """An incidents.jsonl record with every field the report reads checked (a value of the
    wrong kind marked, and None: ``_incidents`` leaves what an earlier record said); None
    (skipped) for a record that is not an incident's or has no id or start step."""
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
    out = {"id": rec["id"], "start": rec["start"], "end": end,
           "state": check("state", lambda v: v in ("opened", "closed"),
                          "\"opened\" or \"closed\"", "opened") or "opened",
           "kinds": check("kinds", lambda v: isinstance(v, list)
                          and all(isinstance(k, str) for k in v), "a list of kinds"),
           "cause": check("cause", lambda v: isinstance(v, str), "a cause or a kind"),
           "trigger": check("trigger", lambda v: isinstance(v, str), "a kind"),
           "check_first": check("check_first", lambda v: isinstance(v, str), "a string"),
           "severity": check("severity", lambda v: v in SEVERITIES, "\"alarm\" or \"notice\""),
           "events": check("events", lambda v: is_step(v) and v >= 0, "a count"),
           "counts": check("counts", lambda v: isinstance(v, dict) and all(
               isinstance(k, str) and is_step(n) and n >= 0 for k, n in v.items()),
               "steps by kind"),
           "dump": check("dump", lambda v: isinstance(v, str), "a path"),
           "message": check("message", lambda v: isinstance(v, str), "a string"),
           "recovered": check("recovered", lambda v: isinstance(v, bool), "true or false"),
           "basis": check("basis", lambda v: v in BASES, "\"direct\", \"recovery\" or "
                          "\"default\""),
           "replay": _replay_of(rec)}
    return out


REPLAY_KEYS = ("reproduced", "first_nonfinite", "culprit_ids", "source", "verdict", "cause",
               "capped", "loss_far")


def _replay_of(rec: dict) -> dict | None:
    """What replay found, where a record carries it (``reproduced``, ``first_nonfinite``,
    ``culprit_ids``, ``source``, ``verdict``, at its top level or under ``replay``); None when
    it carries none. The Monitor writes none: replay runs after training and writes its result
    beside the dump (``_replay_beside``); a tool that logs its findings can also add them to
    the incident's record."""
    src: dict = rec["replay"] if isinstance(rec.get("replay"), dict) else rec
    own = src is not rec or rec.get("record") == "replay"  # an incident's cause is its own
    found = {k: src[k] for k in REPLAY_KEYS if src.get(k) is not None
             and (own or k not in ("cause", "capped", "loss_far"))}
    found = {k: v for k, v in found.items() if isinstance(v, (str, list, int, float))}
    return found or None


def dump_candidates(dump: str, log_dir: str | Path | None) -> list[Path]:
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
    for cand in dump_candidates(dump, log_dir):
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
    data = b""
    try:
        _check_regular(path)
        data = path.read_bytes()
        meta = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:
        why = "empty" if isinstance(exc, ValueError) and not data.strip() else (
            f"cannot be read ({exc.strerror or exc if isinstance(exc, OSError) else exc})")
        problems.skipped.append((path.name, 0, f"{why}: ignored"))
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


def _check_regular(path: Path) -> None:
    """OSError where ``path`` is not a regular file: a directory, or a FIFO or device, which
    the report would wait on (or read without end) instead of reading a file."""
    if not path.is_file():
        raise OSError("a directory, not a file" if path.is_dir() else
                      "not a regular file (a FIFO, socket or device)")


def _records(path: Path, problems: Problems, skip: dict[str, set[int]] | None = None
             ) -> list[tuple[tuple[str, int], dict]]:
    """((file name, line number), record) of every JSON object in ``path`` but the lines
    ``skip`` names for it (an abandoned branch); its unreadable lines go to ``problems``.
    Raises LogError when the file cannot be read at all."""
    try:
        _check_regular(path)
        records, bad = read_jsonl(path)
    except OSError as exc:
        raise LogError(f"fasthealth report: cannot read {path}: {exc.strerror or exc}") from exc
    gone = (skip or {}).get(path.name, set())
    problems.skipped += [(path.name, n, why) for n, why in bad if n not in gone]
    return [((path.name, n), rec) for n, rec in records if n not in gone]


@dataclass
class Log:
    """What ``read_log`` found in a log_dir: every value checked, and ``problems``.
    ``incidents`` is None where the log has no readable incidents.jsonl (a log written before
    incidents existed): not "none happened", but "none recorded"."""

    meta: dict
    steps: list[dict]
    events: list[dict]
    incidents: list[dict] | None
    problems: Problems
    header: list[str] = field(default_factory=list)  # lines before the summary, after it:
    footer: list[str] = field(default_factory=list)  # the run, the others (report/runs.py)
    rollbacks: list[dict] = field(default_factory=list)  # rollbacks.jsonl's (rollback=)


def log_directory(log_dir: str | Path) -> Path:
    """``log_dir`` as a Path; FileNotFoundError or NotADirectoryError, with the message the
    report prints, where it is not a directory."""
    d = Path(log_dir)
    if not d.exists():
        raise FileNotFoundError(f"fasthealth report: {d} not found (no such directory)")
    if not d.is_dir():
        raise NotADirectoryError(f"fasthealth report: {d} is not a directory: give the log_dir "
                                 "a Monitor wrote (Monitor(..., log_dir=...))")
    return d


def read_log(log_dir: str | Path, skip: dict[str, set[int]] | None = None) -> Log:
    """meta.json, steps.jsonl, events.jsonl and incidents.jsonl of a Monitor's log_dir, every
    value checked, and what was wrong (``Problems``). Raises FileNotFoundError (no such
    directory, no steps.jsonl), NotADirectoryError, or LogError (steps.jsonl unreadable, empty,
    or without a single readable step): there is nothing to report. ``skip``: line numbers
    by file left out (a run's abandoned branch, ``report/runs.py``)."""
    d = log_directory(log_dir)
    steps_path = d / "steps.jsonl"
    if not steps_path.is_file():
        raise FileNotFoundError(f"fasthealth report: {steps_path} not found: is {d} a Monitor's "
                                "log_dir? (a Monitor given log_dir= writes steps.jsonl, "
                                "events.jsonl and meta.json there)")
    problems = Problems()
    meta = _read_meta(d / "meta.json", problems)
    raw = _records(steps_path, problems, skip)
    steps = [r for r in (_clean_step(w, rec, problems) for w, rec in raw) if r is not None]
    if not steps:
        if not raw and not any(f == steps_path.name for f, _, _ in problems.skipped):
            raise LogError(f"fasthealth report: {steps_path} is empty: no step was logged")
        raise LogError(f"fasthealth report: no line of {steps_path} is a step record\n"
                       + problems.text(d))
    raw_ev = _optional(d / "events.jsonl", problems, skip, "events")
    events = [_clean_event(w, rec, problems) for w, rec in raw_ev or []]
    incidents = None
    raw_inc = _optional(d / "incidents.jsonl", problems, skip, "incidents")
    if raw_inc is not None:
        incidents = _incidents([r for r in (_clean_incident(w, rec, problems)
                                            for w, rec in raw_inc) if r is not None], events)
        for inc in incidents:
            if inc.get("dump") and not inc.get("replay"):
                inc["replay"] = _replay_beside(inc["dump"], d, problems)
            one_cause(inc)
    raw_rb = _optional(d / "rollbacks.jsonl", problems, skip, "rollbacks")
    rollbacks = [r for r in (_clean_rollback(w, rec, problems) for w, rec in raw_rb or [])
                 if r is not None]
    return Log(meta, steps, events, incidents, problems, rollbacks=rollbacks)


def _optional(path: Path, problems: Problems, skip: dict[str, set[int]] | None,
              what: str) -> list[tuple[tuple[str, int], dict]] | None:
    """The records of a file the report can do without: None when it is not there, or when it
    cannot be read (noted: no ``what`` shown; the steps are reported all the same)."""
    if not path.exists():
        return None
    try:
        return _records(path, problems, skip)
    except LogError as exc:
        problems.skipped.append((path.name, 0, f"{str(exc).split(': ', 2)[-1]}: no {what} "
                                 "shown"))
        return None


def _clean_rollback(where: tuple[str, int], rec: dict, problems: Problems) -> dict | None:
    """A rollbacks.jsonl record whose steps and incident are integers, else None (noted)."""
    if rec.get("record") == "rollback" and all(
            isinstance(rec.get(k), int) and not isinstance(rec.get(k), bool)
            for k in ("step", "to_step", "incident")):
        ids = rec.get("quarantined")
        return {**rec, "quarantined": ids if isinstance(ids, list) else [],
                "reason": str(rec.get("reason", ""))}
    problems.skipped.append((*where, "not a rollback record (record, step, to_step, incident)"))
    return None


def one_cause(inc: dict) -> None:
    """One cause per incident: a replay's cause replaces the incident's own when that was
    named by whether the loss came back or by its first alarm's default (a replay re-ran the
    step: it saw whether this batch, the weights or neither made the fault), not when the
    incident's evidence named it directly (a weight scan's finding, a learning-rate jump:
    ``monitor/causes.py``). ``cause_by`` says whose it is ("replay" or "incident");
    ``incident_cause`` keeps the incident's own when the replay's replaced it."""
    r = inc.get("replay") or {}
    theirs = r.get("cause")
    inc["cause_by"] = "incident"
    if theirs in kinds.CAUSES and inc.get("basis") in (RECOVERY, DEFAULT):
        inc["cause_by"] = "replay"
        if theirs != inc["cause"]:
            inc["incident_cause"], inc["cause"] = inc["cause"], theirs
            inc["check_first"] = CHECK_FIRST[theirs]


def _incidents(records: list[dict], events: list[dict]) -> list[dict]:
    """The incidents of incidents.jsonl's ``records`` (checked by ``_clean_incident``), in
    order of their start. An incident is keyed by id and start: a reopened log_dir numbers its
    incidents from 0 again, and an incident's start never changes. Each later record of an
    incident updates what the earlier ones said (a field it has wrong leaves theirs); a closed
    incident is not reopened. One whose log ends before it closed (a killed run) reaches to the
    last of the events filed under it (by their ``incident`` id, from its start on)."""
    by_key: dict[tuple[int, int], dict] = {}
    for r in records:
        old = by_key.setdefault((r["id"], r["start"]), {})
        if old.get("state") == "closed" and r["state"] == "opened":
            continue
        old.update({k: v for k, v in r.items() if v is not None})
    starts: dict[int, list[int]] = {}
    for i, s in sorted(by_key):
        starts.setdefault(i, []).append(s)
    filed: dict[tuple[int, int], list[int]] = {}
    for e in events:
        inc_id = e.get("incident")
        if inc_id is None or not is_step(e["step"]):
            continue
        before = [s for s in starts.get(inc_id, []) if s <= e["step"]]
        if before:  # the incident of that id that started last at or before the event
            filed.setdefault((inc_id, before[-1]), []).append(e["step"])
    for key, r in by_key.items():
        r["kinds"] = r.get("kinds") or []
        r["cause"] = r.get("cause") or (r["kinds"][0] if r["kinds"] else "?")
        if r["cause"] not in kinds.CAUSES:  # a log from before causes: its cause is a kind
            r["trigger"] = r.get("trigger") or r["cause"]
            r["cause"] = "?"
        r["trigger"] = r.get("trigger") or (r["kinds"][0] if r["kinds"] else "?")
        r["check_first"] = r.get("check_first") or ""
        r["severity"] = r.get("severity") or (
            ALARM if any(kinds.severity_of(k) == ALARM for k in r["kinds"]) else kinds.NOTICE)
        r["end"] = r.get("end", r["start"])
        r["events"] = r.get("events") or 0
        if r["state"] != "closed" and key in filed:
            r["end"] = max(r["end"], *filed[key])
            r["events"] = max(r["events"], len(filed[key]))
    return sorted(by_key.values(), key=lambda r: (r["start"], r["id"]))
