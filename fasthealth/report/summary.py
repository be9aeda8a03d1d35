"""The text summary of a log: the run, its incidents (a table: span, severity, cause, kinds,
events, the dump and what replay found), then its events, alarms and notices counted apart."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from ..monitor.kinds import ALARM, SEVERITIES
from .read import as_float, dump_candidates, is_step

LISTED = 30  # incidents of each severity listed one by one in the summary; past that, a count


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _dump_shown(dump: str, log_dir: str | Path | None) -> tuple[str, bool]:
    """The dump's path as the summary shows it (under the log_dir: relative to it) and whether
    the file is there (also when the log_dir was moved: then it is in its dumps/)."""
    if log_dir is None:
        return dump, Path(dump).exists()
    d = Path(log_dir)
    for cand in dump_candidates(dump, log_dir):
        try:
            if cand.exists():
                try:
                    return str(cand.resolve().relative_to(d.resolve())), True
                except ValueError:
                    return str(cand), True
        except OSError:
            continue
    return dump, False


def replay_line(inc: dict, log_dir: str | Path | None) -> str | None:
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
                     "does not reproduce, its loss far from the recorded one (the dump may not "
                     "hold the batch trained on: a prefetched one, one micro-batch of the step)"
                     if r.get("loss_far") else
                     "does not reproduce (a transient fault, not this batch)")
    if r.get("first_nonfinite"):
        found.append(f"first non-finite module {r['first_nonfinite']}")
    if r.get("source"):
        found.append(f"source {r['source']}")
    if r.get("culprit_ids") is not None:
        ids = r["culprit_ids"] if isinstance(r["culprit_ids"], list) else [r["culprit_ids"]]
        found.append("samples " + ", ".join(map(str, ids[:10]))
                     + (f" (and {len(ids) - 10} more)" if len(ids) > 10 else ""))
    capped = " (search capped)" if r.get("capped") else ""
    if r.get("cause") and inc.get("incident_cause"):  # the replay's replaced it
        found.append(f"likely cause {r['cause']}{capped}, which replaces the incident's "
                     f"{inc['incident_cause']} (judged from whether the loss came back)")
    elif r.get("cause") and r["cause"] != inc.get("cause"):
        found.append(f"likely cause {r['cause']}{capped}, set aside: the incident's own "
                     f"evidence names {inc.get('cause')} directly")
    elif r.get("cause"):
        found.append(f"likely cause {r['cause']}{capped}, as the incident's")
    if r.get("verdict") and not found:
        found.append(str(r["verdict"]))
    return f"dump {path}; replay: " + "; ".join(found)


def replay_brief(r: dict | None, cause: str | None = None) -> str | None:
    """What replay found, in a few words for a plot label: the samples (when the ``cause`` shown
    is the batch, or unknown), else the first module, else the source, else "transient"; None
    when not replayed."""
    if not r:
        return None
    if r.get("reproduced") is False:
        return "not the batch trained on?" if r.get("loss_far") else "transient"
    ids = r.get("culprit_ids")
    if isinstance(ids, list) and ids and cause in (None, "batch"):
        return "samples " + ",".join(map(str, ids[:3])) + (" ..." if len(ids) > 3 else "")
    if r.get("first_nonfinite"):
        return str(r["first_nonfinite"])
    if r.get("source"):
        return f"source {r['source']}"
    return "reproduces" if r.get("reproduced") else None


def with_counts(kinds: list[str], counts: dict | None) -> list[str]:
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


def incident_table(incidents: list[dict] | None, log_dir: str | Path | None = None
                   ) -> list[str]:
    """The summary's lines on incidents: a count by severity, then a table of them (alarms,
    then notices, each in order of their start, the first LISTED of each one by one).
    ``incidents`` None: the log recorded none (``Log.incidents``)."""
    if incidents is None:
        return ["  incidents: not recorded (no readable incidents.jsonl in this log)"]
    alarms = [i for i in incidents if i["severity"] == ALARM]
    notices = [i for i in incidents if i["severity"] != ALARM]
    if not incidents:
        return ["  incidents: none"]
    lines = [f"  incidents: {len(incidents)} ({_plural(len(alarms), 'alarm')}, "
             f"{_plural(len(notices), 'notice')})",
             f"    {'id':<5} {'steps':<17} {'severity':<9} {'events':>6}  {'cause':<15} "
             f"{'trigger':<26} kinds"]
    for group in (alarms, notices):
        for inc in group[:LISTED]:
            span = f"{inc['start']}-{inc['end']}" + (
                " open" if inc["state"] != "closed" else
                " not back" if inc.get("recovered") is False else "")
            kinds = _kinds_shown(with_counts(inc["kinds"], inc.get("counts")))
            lines.append(f"    {'#' + str(inc['id']):<5} {span:<17} {inc['severity']:<9} "
                         f"{inc['events']:>6}  {inc['cause']:<15} {inc.get('trigger', '?'):<26} "
                         f"{kinds}")
            if inc.get("check_first"):
                lines.append(f"          check first: {inc['check_first']}")
            more = replay_line(inc, log_dir)
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
            incidents: list[dict] | None = None, log_dir: str | Path | None = None,
            rollbacks: list[dict] | None = None) -> str:
    """The text summary of a log as ``read_log`` returns it: the run, its incidents (None: not
    recorded), its rollbacks, its events, alarms then notices. ``log_dir``: where the dumps'
    paths are shown from."""
    if not steps:
        return "fasthealth report: no steps logged"
    losses = [as_float(r.get("loss")) for r in steps]
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
    norms = [v for v in (as_float(r.get("grad_norm")) for r in steps) if math.isfinite(v)]
    if norms:
        lines.append(f"  global grad norm: median {sorted(norms)[len(norms) // 2]:.4g}, "
                     f"max {max(norms):.4g}")
    lines += incident_table(incidents, log_dir)
    if rollbacks:
        lines.append(f"  rollbacks: {len(rollbacks)}")
        for r in rollbacks:
            ids = len(r["quarantined"])
            lines.append(f"    at step {r['step']} back to the end of step {r['to_step']} "
                         f"(incident #{r['incident']}: {r['reason']})"
                         + (f"; {_plural(ids, 'sample')} quarantined" if ids else "")
                         + {"batch": "; its first alarm's batch bad on the older state too: "
                            "the data", "state": "; its first alarm's batch fine on the older "
                            "state: the batch with the state the run had reached"}.get(
                                str(r.get("replay")), ""))
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

