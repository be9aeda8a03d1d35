"""``report.html``: the summary, the incident and event tables and the figure in one page, and
``report.png`` (the figure) beside it.

A report never replaces a file it did not write. Both files carry a mark (a comment at the top
of the page, a ``tEXt`` chunk in the image); where ``report.html`` or ``report.png`` exists
without it (the user's own page, a file of that name from elsewhere, or a report written before
the mark existed), the report goes to ``report-1.html`` and ``report-1.png`` instead, or the
first such pair that is free or ours, and the CLI says so.
"""

from __future__ import annotations

import base64
import html
import io
import warnings
from pathlib import Path

from ..monitor import kinds
from ..monitor.kinds import ALARM
from .plots import LABEL_COLORS, figure
from .read import Log
from .runs import mark_figure, read_run
from .summary import replay_line, summary, with_counts

HTML_MARK = "<!-- written by fasthealth report: a later report may replace this file -->"
PNG_KEY, PNG_TEXT = "fasthealth", "report"  # the image's tEXt chunk: its keyword and text
PNG_MARK = f"{PNG_KEY}\0{PNG_TEXT}".encode("latin-1")  # that chunk's data, as stored
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write(log_dir: str | Path, out: str | Path | None = None, run: str | None = None
          ) -> tuple[Path, str]:
    """Reads a run of ``log_dir`` (``runs.read_run``: the latest, or ``run``; problems warned)
    and writes report.html and report.png into ``out`` (default: the run's directory; see
    ``report_paths``); returns the page's path and the text summary."""
    chosen, log = read_run(log_dir, run)
    if log.problems.skipped or log.problems.marked:
        warnings.warn(log.problems.text(chosen.dir), RuntimeWarning, stacklevel=2)
    return write_report(chosen.dir, log, out=out)


def _is_our_page(path: Path) -> bool:
    with open(path, "rb") as f:
        return HTML_MARK.encode() in f.read(4096)


def _is_our_png(path: Path) -> bool:
    """Whether ``path`` is a PNG with fasthealth's tEXt chunk (read chunk by chunk)."""
    data = path.read_bytes()
    at = len(PNG_SIGNATURE)
    if not data.startswith(PNG_SIGNATURE):
        return False
    while at + 8 <= len(data):
        size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        if kind == b"tEXt" and data[at + 8:at + 8 + size] == PNG_MARK:
            return True
        if kind == b"IEND":
            break
        at += 12 + size  # length, type, data, CRC
    return False


def _free_or_ours(path: Path, ours) -> bool:
    if not path.exists():
        return True
    try:
        return path.is_file() and ours(path)
    except OSError:  # what cannot be read is not known to be ours: left alone
        return False


def report_paths(out: Path) -> tuple[Path, Path]:
    """Where the page and the image go in ``out``: report.html and report.png where each is
    absent or written by fasthealth, else the first report-N.html / report-N.png that are."""
    n = 0
    while True:
        stem = "report" if n == 0 else f"report-{n}"
        page, png = out / f"{stem}.html", out / f"{stem}.png"
        if _free_or_ours(page, _is_our_page) and _free_or_ours(png, _is_our_png):
            return page, png
        n += 1


NOTICE_ROW = " style='color:#777'"  # a notice's row in the event table: muted


def _still(inc: dict) -> str:
    """What the steps column adds: an incident still open, or one the run never came back
    from (closed at its end, its loss still up)."""
    if inc["state"] != "closed":
        return " (open)"
    return " (not back at the end)" if inc.get("recovered") is False else ""


def _incident_rows(incidents: list[dict] | None, log_dir: str | Path) -> str:
    e = html.escape
    if incidents is None:
        return "<tr><td colspan=7>not recorded (no readable incidents.jsonl in this log)</td></tr>"
    rows = []
    for inc in incidents:
        sev = inc["severity"]
        more = replay_line(inc, log_dir) or ""
        rows.append(
            f"<tr style='color:{LABEL_COLORS[sev]}'><td>#{e(str(inc['id']))}</td>"
            f"<td>{inc['start']}-{inc['end']}{_still(inc)}"
            f"</td><td>{e(sev)}</td><td>{e(inc['cause'])} ({e(inc.get('trigger', '?'))})</td>"
            f"<td>{e(', '.join(with_counts(inc['kinds'], inc.get('counts'))))}"
            f"</td><td>{inc['events']}</td><td>{e(more)}</td></tr>")
    return "\n".join(rows) or "<tr><td colspan=7>none</td></tr>"


def _event_rows(events: list[dict]) -> str:
    e = html.escape
    rows = "\n".join(
        f"<tr{NOTICE_ROW if ev['severity'] != ALARM else ''}>"
        f"<td>{'?' if ev['step'] is None else e(str(ev['step']))}</td>"
        f"<td style='color:{kinds.colour_of(ev['kind'])}'>"
        f"{e(ev['kind'])}</td><td>{e(ev['severity'])}</td>"
        f"<td>{'' if ev.get('incident') is None else '#' + e(str(ev['incident']))}</td>"
        f"<td>{e(ev['message'])}</td>"
        f"<td>{e(Path(ev['dump']).name) if ev.get('dump') else ''}</td></tr>"
        for ev in events)
    return rows or "<tr><td colspan=6>none</td></tr>"


def write_report(log_dir: str | Path, log: Log, out: str | Path | None = None
                 ) -> tuple[Path, str]:
    """``write`` for a log already read: the page and the image into ``out`` (default:
    ``log_dir``) under the names ``report_paths`` gives; returns the page's path and the text
    summary."""
    text = "\n".join([*log.header, summary(log.meta, log.steps, log.events, log.incidents,
                                           log_dir, log.rollbacks), *log.footer])
    out = Path(out) if out is not None else Path(log_dir)
    out.mkdir(parents=True, exist_ok=True)
    page_path, png_path = report_paths(out)
    fig = figure(log.meta, log.steps, log.events, log.incidents)
    mark_figure(fig, log.meta)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, metadata={PNG_KEY: PNG_TEXT})
    import matplotlib.pyplot as plt  # optional, as in plots.py; figure() imported it already

    plt.close(fig)
    png_path.write_bytes(buf.getvalue())
    img = base64.b64encode(buf.getvalue()).decode()
    page = f"""<!doctype html>{HTML_MARK}
<html><head><meta charset="utf-8">
<title>fasthealth report: {html.escape(str(log_dir))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}pre{{background:#f6f6f6;padding:1em}}
</style></head><body>
<h1>fasthealth report</h1><p>{html.escape(str(Path(log_dir).resolve()))}</p>
<pre>{html.escape(text)}</pre>
<h2>Incidents</h2><table><tr><th>id</th><th>steps</th><th>severity</th><th>cause</th>
<th>kinds</th><th>events</th><th>dump</th></tr>
{_incident_rows(log.incidents, log_dir)}</table>
<h2>Events</h2><table><tr><th>step</th><th>kind</th><th>severity</th><th>incident</th>
<th>message</th><th>dump</th></tr>
{_event_rows(log.events)}</table>
<h2>Plots</h2><img src="data:image/png;base64,{img}" style="max-width:100%">
</body></html>"""
    page_path.write_text(page, encoding="utf-8")  # as the page declares
    return page_path, text
