"""``report.html``: the summary, the incident and event tables and the figure in one page, and
``report.png`` (the figure) beside it."""

from __future__ import annotations

import base64
import html
import io
import warnings
from pathlib import Path

from ..monitor.events import ALARM
from .plots import EVENT_COLORS, LABEL_COLORS, figure
from .read import _severe, incidents_of, read_log
from .summary import _replay_line, _with_counts, summary


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


