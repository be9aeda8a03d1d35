"""The Markdown tables of docs/performance.md ("Detector accuracy") from
bench/results/detectors.json, side by side for the entries given (the last one is "now").

    python evaluation/detector_tables.py KEY [KEY ...]   # e.g. "2026-12-01 67eb661"

Nothing is measured here: the figures are read from the file that eval_detectors.py wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite


def _get(d: dict, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _num(x) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def _held(res: dict) -> dict | None:
    return _get(res, "final", "held_out_defaults")


def summary(results: dict, labels: list[str]) -> list[str]:
    rows = [("| | " + " | ".join(labels) + " |"), "|---|" + "---|" * len(labels)]

    def row(title, f):
        rows.append(f"| {title} | " + " | ".join(f(results[x]) for x in labels) + " |")

    def tot(res):
        return res["defaults"]["totals"]

    row("tuning families: alarms /10k healthy steps (families alarming)",
        lambda r: f"{tot(r)['alarms_per_10k']} ({tot(r)['families_with_alarms']} of "
                  f"{tot(r)['families']})")
    row("tuning families: notices recorded /10k", lambda r: _num(tot(r)["notices_per_10k"]))
    row("tuning fault runs caught within their delay",
        lambda r: f"{tot(r)['fault_runs_caught']}/{tot(r)['fault_runs']}")

    def one_incident(res, key):
        faults = res["defaults"]["faults"]
        if all(f.get(f"mean_{key}") is None for f in faults.values()):
            return "(no incidents)"
        ones = sum(1 for f in faults.values() if f.get(f"max_{key}") == 1
                   and min(x[key] for x in f["runs"]) == 1)
        return f"{ones} of {len(faults)}"

    row("tuning faults with exactly 1 incident in every run",
        lambda r: one_incident(r, "incidents_after"))
    row("... 1 alarm incident in every run", lambda r: one_incident(r, "alarm_incidents_after")
        if any("alarm_incidents_after" in x for f in r["defaults"]["faults"].values()
               for x in f["runs"]) else "(not counted)")

    def held(res, f):
        h = _held(res)
        return "not run" if h is None else f(h["totals"])

    row("**held out**: healthy steps", lambda r: held(r, lambda t: _num(t["healthy_steps"])))
    row("**held out**: alarms (notices /10k)",
        lambda r: held(r, lambda t: f"**{t['alarms']}** ({t['notices_per_10k']})"))
    row("**held out**: fault runs caught",
        lambda r: held(r, lambda t: f"**{t['fault_runs_caught']}/{t['fault_runs']}**"))
    return rows


def families(results: dict, labels: list[str]) -> list[str]:
    now = results[labels[-1]]["defaults"]["families"]
    rows = ["| healthy family (tuning) | " + " | ".join(f"alarms /10k {x}" for x in labels)
            + " | notices /10k now |", "|---|" + "---|" * (len(labels) + 1)]
    for name in sorted(now):
        cells = [_num(_get(results[x], "defaults", "families", name, "alarms_per_10k"))
                 for x in labels]
        notices = _num(now[name]["notices_per_10k"])
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {notices} |")
    return rows


def faults(results: dict, labels: list[str]) -> list[str]:
    """Per tuning fault: caught under every label; events per run under the first and the last
    label, incidents per run under the first label that has them and the last."""
    last = labels[-1]
    now = results[last]["defaults"]["faults"]
    with_incidents = [x for x in labels if any(
        f.get("mean_incidents_after") is not None
        for f in results[x]["defaults"]["faults"].values())]
    ev_labels = list(dict.fromkeys([labels[0], last]))
    inc_labels = list(dict.fromkeys((with_incidents[:1] or [last]) + [last]))
    rows = ["| fault (tuning) | " + " | ".join(f"caught {x}" for x in labels)
            + " | delays now (allowed) | " + " | ".join(f"events/run {x}" for x in ev_labels)
            + " | alarms/run now | " + " | ".join(f"incidents/run {x}" for x in inc_labels)
            + " | alarm incidents/run now |",
            "|---|" + "---|" * (len(labels) + len(ev_labels) + len(inc_labels) + 3)]
    for name in sorted(now):
        f = now[name]

        def at(label, key, name=name):
            return _get(results[label], "defaults", "faults", name, key)

        caught = [f"{at(x, 'caught')}/{len(at(x, 'runs') or [])}" if at(x, "runs") else "-"
                  for x in labels]
        delays = ",".join(_num(d) for d in f["delays"])
        rows.append(
            f"| {name} | " + " | ".join(caught) + f" | {delays} ({f['max_delay']}) | "
            + " | ".join(_num(at(x, "mean_events_after")) for x in ev_labels)
            + f" | {_num(f['mean_alarms_after'])} | "
            + " | ".join(_num(at(x, "mean_incidents_after")) for x in inc_labels)
            + f" | {_num(f.get('mean_alarm_incidents_after'))} |")
    return rows


def held_out(results: dict, label: str) -> list[str]:
    h = _held(results[label])
    if h is None:
        return [f"({label}: the held-out part was not run)"]
    rows = ["| held-out family | healthy steps | alarms | notices /10k |", "|---|---|---|---|"]
    for name, f in h["families"].items():
        rows.append(f"| {name} | {f['healthy_steps']} | {f['alarms']} | {f['notices_per_10k']} |")
    rows += ["", "| held-out fault | caught | delays (allowed) | events/run | incidents/run | "
                 "alarm incidents/run |", "|---|---|---|---|---|---|"]
    for name, f in h["faults"].items():
        delays = ",".join(_num(d) for d in f["delays"])
        rows.append(f"| {name} | {f['caught']}/{len(f['runs'])} | {delays} ({f['max_delay']}) | "
                    f"{_num(f['mean_events_after'])} | {_num(f['mean_incidents_after'])} | "
                    f"{_num(f.get('mean_alarm_incidents_after'))} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("labels", nargs="+", metavar="KEY",
                    help="keys of detectors.json (date and commit), oldest first")
    ap.add_argument("--file", default=str(RESULTS / "detectors.json"))
    args = ap.parse_args(argv)
    results = json.loads(Path(args.file).read_text())
    missing = [x for x in args.labels if x not in results]
    if missing:
        ap.error(f"no such entry in {args.file}: {', '.join(missing)} "
                 f"(it has: {', '.join(k for k in results if k not in ('corpus',))})")
    for part in (summary(results, args.labels), families(results, args.labels),
                 faults(results, args.labels), held_out(results, args.labels[-1])):
        print("\n".join(part) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
