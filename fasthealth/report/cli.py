"""`fasthealth report LOG_DIR`: plots and a summary from a Monitor's log directory.

Reads ``steps.jsonl`` / ``events.jsonl`` / ``incidents.jsonl`` / ``meta.json`` and writes
``report.html`` (the plots embedded, plus the incident and event tables) and ``report.png`` (the
same plots as one image) into the log directory, and prints a short text summary: the run, its
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
from .read import LogError, read_log
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
    ap.add_argument("--out", help="where to write report.html/png (default: LOG_DIR)")
    args = ap.parse_args(argv)
    try:
        log = read_log(args.log_dir)
    except (OSError, LogError) as exc:
        return _nothing_read(args.log_dir, exc)
    if log.problems.skipped or log.problems.marked:
        print(log.problems.text(args.log_dir), file=sys.stderr)
    try:  # an optional dependency: without it, the text summary only
        import matplotlib  # noqa: F401
    except ImportError:
        print(summary(log.meta, log.steps, log.events, log.incidents, args.log_dir))
        print("fasthealth report: the plots and report.html need matplotlib: "
              "pip install 'fasthealth[report]' (or: pip install matplotlib)", file=sys.stderr)
        return 1
    out = args.out if args.out is not None else args.log_dir
    try:
        path, text = write_report(args.log_dir, log, out=out)
    except OSError as exc:  # a read-only log_dir: the summary all the same, and where to go
        print(summary(log.meta, log.steps, log.events, log.incidents, args.log_dir))
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
