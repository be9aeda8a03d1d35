"""`fasthealth report LOG_DIR`: plots and a summary from a Monitor's log directory.

Reads ``steps.jsonl`` / ``events.jsonl`` / ``meta.json`` and writes ``report.html`` (the plots
embedded, plus the event table) and ``report.png`` (the same plots as one image) into the log
directory, and prints a short text summary.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
from collections import Counter
from pathlib import Path

EVENT_COLORS = {
    "nonfinite_loss": "#d62728", "nonfinite_grad": "#ff7f0e", "loss_spike": "#9467bd",
    "grad_norm_spike": "#8c564b", "divergence": "#e377c2", "oscillation": "#17becf",
    "vanishing_grad": "#7f7f7f", "optimizer_state_nonfinite": "#bcbd22",
    "loss_scale_collapse": "#1f77b4",
}


def load(log_dir: str | Path) -> tuple[dict, list[dict], list[dict]]:
    d = Path(log_dir)
    steps_path = d / "steps.jsonl"
    if not steps_path.exists():
        raise FileNotFoundError(f"fasthealth: {steps_path} not found: is {d} a Monitor log_dir?")
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    steps = [json.loads(s) for s in steps_path.read_text().splitlines() if s.strip()]
    ev_path = d / "events.jsonl"
    events = ([json.loads(s) for s in ev_path.read_text().splitlines() if s.strip()]
              if ev_path.exists() else [])
    return meta, steps, events


def _num(v) -> float:
    return float(v) if v is not None else math.nan


def summary(meta: dict, steps: list[dict], events: list[dict]) -> str:
    if not steps:
        return "fasthealth report: no steps logged"
    losses = [_num(r["loss"]) for r in steps]
    finite = [v for v in losses if math.isfinite(v)]
    lines = [f"fasthealth report: steps {steps[0]['step']}..{steps[-1]['step']} "
             f"({len(steps)} logged)"]
    if finite:
        lines.append(f"  loss: first {finite[0]:.4g}, last {finite[-1]:.4g}, "
                     f"min {min(finite):.4g}, max {max(finite):.4g}")
    bad = [r["step"] for r in steps if not (r.get("loss_finite") and r.get("grads_finite"))]
    skipped = [r["step"] for r in steps if r.get("skipped")]
    lines.append(f"  non-finite steps: {len(bad)}" + (f" (first at {bad[0]})" if bad else "")
                 + f"; skipped steps: {len(skipped)}")
    norms = [_num(r["grad_norm"]) for r in steps if math.isfinite(_num(r["grad_norm"]))]
    if norms:
        lines.append(f"  global grad norm: median {sorted(norms)[len(norms) // 2]:.4g}, "
                     f"max {max(norms):.4g}")
    counts = Counter(e["kind"] for e in events)
    if counts:
        lines.append("  events:")
        for kind, n in counts.most_common():
            first = min(e["step"] for e in events if e["kind"] == kind)
            lines.append(f"    {kind:<26} {n:>4}  (first at step {first})")
    else:
        lines.append("  events: none")
    return "\n".join(lines)


def _loss_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]) -> None:
    """The loss curve, events marked on it."""
    loss = [_num(r["loss"]) for r in steps]
    positive = [v for v in loss if math.isfinite(v) and v > 0]
    use_log = bool(positive) and max(positive) / min(positive) > 50
    ax.plot(xs, [v if (v > 0 or not use_log) else math.nan for v in loss], lw=1, color="black",
            label="loss")
    if use_log:
        ax.set_yscale("log")
    at = {r["step"]: v for r, v in zip(steps, loss)}
    top = max(positive) if positive else 1.0
    seen: set[str] = set()
    for e in events:
        y = at.get(e["step"], math.nan)
        y = y if math.isfinite(y) and (y > 0 or not use_log) else top
        c = EVENT_COLORS.get(e["kind"], "gray")
        ax.scatter([e["step"]], [y], color=c, marker="v", s=28, zorder=3,
                   label=e["kind"] if e["kind"] not in seen else None)
        seen.add(e["kind"])
    ax.set_title("loss" + (" (log scale)" if use_log else "") + ", events marked")
    ax.legend(fontsize=7, loc="upper left", ncol=4)


def _timeline_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                    ) -> None:
    """One row of event marks per kind."""
    kinds = [k for k in EVENT_COLORS if any(e["kind"] == k for e in events)]
    for i, k in enumerate(kinds):
        st = [e["step"] for e in events if e["kind"] == k]
        ax.scatter(st, [i] * len(st), color=EVENT_COLORS[k], marker="|", s=120)
    ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    if xs:
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.set_title("events by kind")


def _grad_norm_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                     ) -> None:
    gn = [_num(r["grad_norm"]) for r in steps]
    ax.plot(xs, [v if v > 0 else math.nan for v in gn], lw=1, color="#1f77b4")
    if meta.get("max_grad_norm"):
        ax.axhline(meta["max_grad_norm"], color="red", ls="--", lw=1, label="max_grad_norm")
        ax.legend(fontsize=7)
    ax.set_yscale("log")
    ax.set_title("global gradient norm (log scale)")


def _nonfinite_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                     ) -> None:
    """NaN and Inf gradient values per step; non-finite losses and skipped steps marked."""
    nan = [r.get("nan_count") or 0 for r in steps]
    inf = [r.get("inf_count") or 0 for r in steps]
    ax.bar(xs, nan, color="#d62728", label="NaN gradient values", width=1.0)
    ax.bar(xs, inf, bottom=nan, color="#ff7f0e", label="Inf gradient values", width=1.0)
    lossbad = [r["step"] for r in steps if not r.get("loss_finite", True)]
    if lossbad:
        ax.scatter(lossbad, [0] * len(lossbad), marker="x", color="black", zorder=3,
                   label="non-finite loss")
    skipped = [r["step"] for r in steps if r.get("skipped")]
    if skipped:
        ax.scatter(skipped, [0] * len(skipped), marker="|", s=200, color="green", zorder=3,
                   label="skipped step")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("non-finite gradient values per step (symlog)")
    ax.legend(fontsize=7)


def _heatmap_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                   ) -> None:
    """log10 of each tensor's gradient norm, at the steps with per-tensor records."""
    per = [(r["step"], r["per_tensor_norms"]) for r in steps if r.get("per_tensor_norms")]
    names = meta.get("names") or (list(per[0][1]) if per else [])
    if per and names:
        import numpy as np

        grid = [[math.log10(v) if v is not None and v > 0 else math.nan
                 for v in (p.get(n) for n in names)] for _, p in per]
        arr = np.ma.masked_invalid(np.array(grid, dtype=float).T)
        px = [p_[0] for p_ in per]
        edges = [px[0] - 0.5] + [(a + b) / 2 for a, b in zip(px, px[1:])] + [px[-1] + 0.5]
        im = ax.pcolormesh(edges, np.arange(len(names) + 1) - 0.5, arr, cmap="viridis",
                           shading="flat")
        ax.invert_yaxis()
        step = max(1, len(names) // 25)
        ax.set_yticks(range(0, len(names), step), [names[i] for i in range(0, len(names), step)],
                      fontsize=6)
        ax.figure.colorbar(im, ax=ax, label="log10 grad norm")
    ax.set_title("per-tensor gradient norm (log10), steps with per-tensor records")


def _lr_scale_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                    ) -> None:
    lr = [_num(r.get("lr")) for r in steps]
    lines = ax.plot(xs, lr, color="#2ca02c", label="learning rate")
    if any(v > 0 for v in lr if math.isfinite(v)):
        ax.set_yscale("log")
    ax.set_ylabel("learning rate (log)")
    scale = [_num(r.get("loss_scale")) for r in steps]
    if any(math.isfinite(v) for v in scale):
        ax2 = ax.twinx()
        lines += ax2.plot(xs, scale, color="#1f77b4", label="loss scale (right)")
        ax2.set_yscale("log")
        ax2.set_ylabel("loss scale (log)")
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="lower left")
    ax.set_title("learning rate and loss scale")


PANELS = ((_loss_panel, 3), (_timeline_panel, 1.6), (_grad_norm_panel, 2),
          (_nonfinite_panel, 2), (_heatmap_panel, 3), (_lr_scale_panel, 2))


def figure(meta: dict, steps: list[dict], events: list[dict]):
    """The report's plots, one panel of PANELS each, as one matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["step"] for r in steps]
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(11, 17), sharex=False,
                             gridspec_kw={"height_ratios": [h for _, h in PANELS]})
    for ax, (panel, _) in zip(axes, PANELS):
        panel(ax, meta, steps, events, xs)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write(log_dir: str | Path, out: str | Path | None = None) -> tuple[Path, str]:
    meta, steps, events = load(log_dir)
    text = summary(meta, steps, events)
    out = Path(out) if out is not None else Path(log_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = figure(meta, steps, events)
    fig.savefig(out / "report.png", dpi=90)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    img = base64.b64encode(buf.getvalue()).decode()
    rows = "\n".join(
        f"<tr><td>{e['step']}</td><td style='color:{EVENT_COLORS.get(e['kind'], 'gray')}'>"
        f"{html.escape(e['kind'])}</td><td>{html.escape(e['message'])}</td>"
        f"<td>{html.escape(Path(e['dump']).name) if e.get('dump') else ''}</td></tr>"
        for e in events)
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>fasthealth report: {html.escape(str(log_dir))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}pre{{background:#f6f6f6;padding:1em}}
</style></head><body>
<h1>fasthealth report</h1><p>{html.escape(str(Path(log_dir).resolve()))}</p>
<pre>{html.escape(text)}</pre>
<h2>Events</h2><table><tr><th>step</th><th>kind</th><th>message</th><th>dump</th></tr>
{rows or '<tr><td colspan=4>none</td></tr>'}</table>
<h2>Plots</h2><img src="data:image/png;base64,{img}" style="max-width:100%">
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path, text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fasthealth report", description=__doc__)
    ap.add_argument("log_dir", help="a Monitor's log_dir")
    ap.add_argument("--out", help="where to write report.html/png (default: LOG_DIR)")
    args = ap.parse_args(argv)
    try:
        path, text = write(args.log_dir, args.out)
    except FileNotFoundError as exc:
        print(exc)
        return 2
    print(text)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
