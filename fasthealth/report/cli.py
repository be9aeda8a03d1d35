"""`fasthealth report LOG_DIR`: plots and a summary from a Monitor's log directory.

A log directory holds runs (``LOG_DIR/run-NNN/``, one per Monitor that did not continue a run):
the report is of the latest (the one started or resumed last), ``--run ID`` picks another, and
the summary lists the others (id, steps, start, incidents). A directory in the layout from before
runs (``steps.jsonl`` directly in LOG_DIR), or a run's own directory, is reported as one run.
Under torch.distributed with ``all_ranks=True``, rank k's runs are in ``LOG_DIR/rank-k/``: give
that folder to report them.
Records of an abandoned branch (written before a resume from an earlier step, for the steps after
it) are left out of the summary and the plots, and the summary says how many.

Reads the run's ``steps.jsonl`` / ``events.jsonl`` / ``incidents.jsonl`` / ``meta.json`` and
writes ``report.html`` (the plots embedded, plus the incident and event tables) and
``report.png`` (the same plots as one image) into the run's directory (or ``--out``), and prints
a short text summary: the run, its
incidents (one per fault: span, severity, cause, kinds, events, dump), then its events, alarms
and notices counted apart.

What ``fh.replay`` found for an incident's dump (``<dump>.replay.json``, written beside the dump
by the replay) is shown with the incident: reproduced or not, the source, the first module that
made a non-finite value, the samples that alone reproduce it.

A log dir without ``incidents.jsonl`` (written before incidents existed) is reported too; the
summary says that its incidents were not recorded.

A report.html or report.png in the way that ``fasthealth report`` did not write (it marks its
own) is left as it is: the report is written to report-1.html and report-1.png (or the first
such pair free), and stderr says so.

Any file content is read without a traceback: a line that cannot be read (not JSON, binary, a
partial last line left by a killed process) is skipped and a value of the wrong kind (a string
where a number goes) is shown as missing, each named on stderr by its file and line number.
Where nothing can be read (no such directory, no steps.jsonl, an empty or unreadable one) the
reason goes to stderr and the exit status is 2. Where the report cannot be written (a
read-only log_dir) the text summary is printed, stderr says why and names ``--out``, and the
exit status is 1.
"""

from __future__ import annotations

import argparse
import sys

from .html import write_report
from .read import LogError
from .runs import read_run
from .summary import summary


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
    ap.add_argument("--out", help="where to write report.html/png (default: the run's "
                    "directory)")
    ap.add_argument("--run", metavar="ID", help="the run to report (run-NNN, or NNN; default: "
                    "the latest)")
    args = ap.parse_args(argv)
    try:
        chosen, log = read_run(args.log_dir, args.run)
    except (OSError, LogError) as exc:
        return _nothing_read(args.log_dir, exc)
    run_dir = str(chosen.dir)
    if log.problems.skipped or log.problems.marked:
        print(log.problems.text(run_dir), file=sys.stderr)
    try:  # an optional dependency: without it, the text summary only
        import matplotlib  # noqa: F401
    except ImportError:
        print("\n".join([*log.header, summary(log.meta, log.steps, log.events, log.incidents,
                                              run_dir, log.rollbacks), *log.footer]))
        print("fasthealth report: the plots and report.html need matplotlib: "
              "pip install 'fasthealth[report]' (or: pip install matplotlib)", file=sys.stderr)
        return 1
    out = args.out if args.out is not None else run_dir
    try:
        path, text = write_report(run_dir, log, out=out)
    except OSError as exc:  # a read-only log_dir: the summary all the same, and where to go
        print("\n".join([*log.header, summary(log.meta, log.steps, log.events, log.incidents,
                                              run_dir, log.rollbacks), *log.footer]))
        print(f"fasthealth report: cannot write the report to {out}: {exc.strerror or exc}"
              f"{f': {exc.filename}' if exc.filename else ''}; give a folder you can write "
              "to with --out DIR", file=sys.stderr)
        return 1
    print(text)
    if path.name != "report.html":
        print(f"fasthealth report: {out} holds a report.html or report.png that fasthealth "
              f"report did not write: left as it is; this report is {path.name} and "
              f"{path.with_suffix('.png').name}", file=sys.stderr)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
