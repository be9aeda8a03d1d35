"""The report's figure: the loss with incidents shaded and events marked, events by kind, the
global gradient norm, non-finite gradient values, the per-tensor heatmap, the learning rate
and loss scale; each panel drawn only when the log has something for it. matplotlib is
optional (the report extra): it is imported where the drawing happens. Each kind is drawn in
its colour from the kinds registry (``monitor/kinds.py``), in the registry's order; a kind it
does not know (a user's rule, another version's log) gets a stable colour of its own."""

from __future__ import annotations

import math

from ..monitor import kinds
from ..monitor.kinds import ALARM, NOTICE, SEVERITIES
from .heatmap import color_range, heatmap_data
from .read import as_float, is_step
from .summary import replay_brief

# Incidents drawn on the plots and listed in the summary: alarms in red, notices muted
SPAN_COLORS = {ALARM: "#d62728", NOTICE: "#8c8c8c"}
LABEL_COLORS = {ALARM: "#a01010", NOTICE: "#555555"}


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


RESUMED = "resumed after this step"  # the legend's entry for a resume's line


def resume_steps(meta: dict) -> list[int]:
    """The steps the run's resumes went back to (meta.json's ``resumes``), in order."""
    resumes = meta.get("resumes")
    return sorted({r["step"] for r in (resumes if isinstance(resumes, list) else [])
                   if isinstance(r, dict)
                   and isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)})


def _resume_lines(axes: list, meta: dict) -> None:
    """A dotted line after each step a resume went back to, in every panel (what lies right of
    it was written after the resume), and its entry in the first panel's legend."""
    at = resume_steps(meta)
    if not at or not axes:
        return
    for ax in axes:
        lines = [ax.axvline(k + 0.5, color="#555", ls=":", lw=1.2) for k in at]
        if ax is axes[0]:
            lines[0].set_label(RESUMED)
            add_to_legend(ax, lines[:1])  # the panel made its legend before


def add_to_legend(ax, more: list) -> None:
    """``ax``'s legend (``_legend``'s, outside on the right) made again with the handles
    ``more`` after its entries: for what is drawn once the panels are done (a resume's line)."""
    old = ax.get_legend()
    handles = list(old.legend_handles) if old is not None else []
    labels = [t.get_text() for t in old.get_texts()] if old is not None else []
    handles += more
    labels += [h.get_label() for h in more]
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
    loss = [as_float(r.get("loss")) for r in steps]
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
    order = _kind_order(events)
    for sev, kind in sorted(groups, key=lambda g: (SEVERITIES.index(g[0]), order.index(g[1]))):
        c = kinds.colour_of(kind)
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
    """The kinds of ``events``: the registry's in its order, then any others by name."""
    seen = {e["kind"] for e in events}
    known = [k for k in kinds.KINDS if k in seen]
    return known + sorted(seen - set(known))


def _timeline_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                    incidents: list[dict]) -> None:
    """One row of event marks per kind: alarms on top, notices (paler, labelled so) below."""
    order = _kind_order(events)
    rows = sorted({(e["severity"], e["kind"]) for e in events},
                  key=lambda r: (-SEVERITIES.index(r[0]), -order.index(r[1])))
    _spans(ax, incidents, xs)
    for i, (sev, k) in enumerate(rows):
        st = [e["step"] for e in events if e["kind"] == k and e["severity"] == sev]
        ax.scatter(st, [i] * len(st), color=kinds.colour_of(k), marker="|",
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
    gn = [as_float(r.get("grad_norm")) for r in steps]
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



UNRECORDED = "#e0e0e0"  # the heatmap where nothing was recorded
UNSAMPLED = "#c8c8c8"  # hatching on white: steps logged whose per-tensor norms were not sampled


def _heatmap_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                   incidents: list[dict]) -> None:
    """log10 of each tensor's (or layer's) gradient norm, in the recorded steps only
    (``heatmap_data``): gray where nothing was recorded, hatched where steps were logged but
    their norms not sampled (after a record at an event, until the cadence's next), red where a
    norm was not finite, black where it was zero. A one-step column is drawn at least
    ``_min_width`` wide (up to the next record), or a long run would hide it."""
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
    lo, hi = color_range(h, incidents)
    arr[np.isneginf(arr)] = lo - 1.0  # zero norms: below the scale, drawn black
    cmap = colormaps["viridis"].with_extremes(under="black")
    ax.set_facecolor(UNRECORDED)
    edges_y = np.arange(len(h.labels) + 1) - 0.5
    im = ax.pcolormesh(np.array(edges), edges_y, np.ma.masked_invalid(arr), cmap=cmap, vmin=lo,
                       vmax=hi)
    if bad.any():
        ax.pcolormesh(np.array(edges), edges_y, np.ma.masked_where(~bad, np.ones_like(arr)),
                      cmap=matplotlib_red(), vmin=0, vmax=1)
    for a, b in h.unsampled:  # under the mesh: a widened column keeps its place over them
        ax.axvspan(a - 0.5, b - 0.5, facecolor="white", edgecolor=UNSAMPLED, hatch="///",
                   linewidth=0, zorder=0.5)
    ax.invert_yaxis()
    step = max(1, len(h.labels) // 30)
    ax.set_yticks(range(0, len(h.labels), step), h.labels[::step], fontsize=6)
    finite = arr[np.isfinite(arr)]
    over = finite.size and finite.max() > hi
    ax.figure.colorbar(im, cax=ax.inset_axes([1.01, 0.0, 0.015, 1.0]), extend="max" if over
                       else "neither", label="log10 grad norm" + (" (saturated above)" if over
                                                                  else ""))
    what = "layer" if h.by_layer else "tensor"
    ax.set_title(f"per-{what} gradient norm at the recorded steps (log10; gray: not recorded "
                 "or no gradient, black: zero, red: NaN/Inf)"
                 + (f"\nhatched: not sampled (norms every {h.cadence} steps and at events)"
                    if h.unsampled else ""))


def matplotlib_red():
    from matplotlib.colors import ListedColormap  # optional, as every plotting import here

    return ListedColormap(["#d62728"])


def _lr_scale_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int],
                    incidents: list[dict]) -> None:
    lr = [as_float(r.get("lr")) for r in steps]
    lines = []
    if any(math.isfinite(v) for v in lr):
        lines += ax.plot(xs, lr, color="#2ca02c", label="learning rate")
        if any(v > 0 for v in lr if math.isfinite(v)):
            ax.set_yscale("log")
        ax.set_ylabel("learning rate (log)")
    scale = [as_float(r.get("loss_scale")) for r in steps]
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
        brief = replay_brief(inc.get("replay"), inc.get("cause"))
        cause = inc.get("cause") or "?"  # (a log from before causes: its trigger)
        label = cause if cause in kinds.CAUSES else inc.get("trigger") or cause
        texts = ([f"#{inc['id']} {label}: {brief}"] if brief else []) + [
            f"#{inc['id']} {label}", f"#{inc['id']}"]
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
    """The report's plots of a log as ``read_log`` returns it: the panels of PANELS that have
    something to show, one figure; ``incidents`` shaded and labelled (None: not recorded)."""
    import matplotlib  # optional: `fasthealth report` without it writes the text summary

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    events = [e for e in events if is_step(e["step"])]  # the others: only listed
    incidents = incidents or []
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
    _resume_lines(list(axes[:, 0]), meta)
    _label_incidents(axes[0, 0], incidents)
    return fig
