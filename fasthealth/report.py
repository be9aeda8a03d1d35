"""`fasthealth report LOG_DIR`: plots and a summary from a Monitor's log directory.

Reads ``steps.jsonl`` / ``events.jsonl`` / ``meta.json`` and writes ``report.html`` (the plots
embedded, plus the event table) and ``report.png`` (the same plots as one image) into the log
directory, and prints a short text summary.

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
from dataclasses import dataclass, field
from pathlib import Path

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


FILES = ("meta.json", "steps.jsonl", "events.jsonl")  # the order problems are told in


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
    return out


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


def read(log_dir: str | Path) -> tuple[dict, list[dict], list[dict], Problems]:
    """meta.json, steps.jsonl and events.jsonl of a Monitor's log_dir, every value checked, and
    what was wrong (``Problems``). Raises FileNotFoundError (no such directory, no
    steps.jsonl), NotADirectoryError, or LogError (steps.jsonl unreadable, empty, or without a
    single readable step): there is nothing to report."""
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
    return meta, steps, events, problems


def load(log_dir: str | Path) -> tuple[dict, list[dict], list[dict]]:
    """meta.json, steps.jsonl and events.jsonl of a Monitor's log_dir (see ``read``); what was
    skipped or marked (a partial last line, a corrupt one, a value of the wrong kind, each
    with its file and line number) is warned."""
    meta, steps, events, problems = read(log_dir)
    if problems.skipped or problems.marked:
        warnings.warn(problems.text(log_dir), RuntimeWarning, stacklevel=2)
    return meta, steps, events


def _num(v) -> float:
    return float(v) if v is not None else math.nan


def summary(meta: dict, steps: list[dict], events: list[dict]) -> str:
    if not steps:
        return "fasthealth report: no steps logged"
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
    counts = Counter(e["kind"] for e in events)
    if counts:
        lines.append("  events:")
        for kind, n in counts.most_common():
            first = min((e["step"] for e in events if e["kind"] == kind and is_step(e["step"])),
                        default="?")
            lines.append(f"    {kind:<26} {n:>4}  (first at step {first})")
    else:
        lines.append("  events: none")
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


def _legend(ax) -> None:
    """The legend outside the axes, on the right: it hides no data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _loss_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]) -> None:
    """The loss curve; events marked on it (on the top edge where the loss is not finite)."""
    loss = [_num(r.get("loss")) for r in steps]
    positive = [v for v in loss if math.isfinite(v) and v > 0]
    use_log = bool(positive) and max(positive) / min(positive) > 50
    ax.plot(xs, [v if (v > 0 or not use_log) else math.nan for v in loss], lw=1, color="black",
            label="loss")
    if use_log:
        ax.set_yscale("log")
    at = {r["step"]: v for r, v in zip(steps, loss)}
    seen: set[str] = set()
    for e in events:
        y = at.get(e["step"], math.nan)
        ok = math.isfinite(y) and (y > 0 or not use_log)
        c = EVENT_COLORS.get(e["kind"], "gray")
        ax.scatter([e["step"]], [y if ok else 0.97], color=c, marker="v", s=28, zorder=3,
                   transform=ax.transData if ok else ax.get_xaxis_transform(),
                   label=e["kind"] if e["kind"] not in seen else None)
        seen.add(e["kind"])
    _marks(ax, steps)
    ax.set_title("loss" + (" (log scale)" if use_log else "") + ", events marked")
    _legend(ax)


def _timeline_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                    ) -> None:
    """One row of event marks per kind."""
    kinds = [k for k in EVENT_COLORS if any(e["kind"] == k for e in events)]
    kinds += sorted({e["kind"] for e in events} - set(kinds))
    for i, k in enumerate(kinds):
        st = [e["step"] for e in events if e["kind"] == k]
        ax.scatter(st, [i] * len(st), color=EVENT_COLORS.get(k, "gray"), marker="|", s=120)
    ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    ax.set_title("events by kind")


def _grad_norm_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                     ) -> None:
    gn = [_num(r.get("grad_norm")) for r in steps]
    ax.plot(xs, [v if v > 0 else math.nan for v in gn], lw=1, color="#1f77b4",
            label="global grad norm")
    if meta.get("max_grad_norm"):
        ax.axhline(meta["max_grad_norm"], color="red", ls="--", lw=1, label="max_grad_norm")
    ax.set_yscale("log")
    _marks(ax, steps)
    ax.set_title("global gradient norm (log scale)")
    _legend(ax)


def _nonfinite_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                     ) -> None:
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


def _heatmap_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                   ) -> None:
    """log10 of each tensor's (or layer's) gradient norm where it was recorded. A record covers
    the steps up to the next one at the usual cadence and no further: gray where nothing was
    recorded, red where a norm was not finite."""
    import numpy as np  # the plots' dependencies are optional (the report extra)

    per = sorted(((r["step"], r["per_tensor_norms"]) for r in steps if r.get("per_tensor_norms")),
                 key=lambda p: p[0])
    names = meta.get("names") or list(per[0][1])
    labels, members = _heatmap_rows(names)
    lo, hi = min(xs), max(xs)
    width = max(1, math.ceil((hi - lo + 1) / 1000))  # at most 1000 columns
    cols = (hi - lo) // width + 1
    arr = np.full((len(labels), cols), np.nan)
    bad = np.zeros((len(labels), cols), dtype=bool)
    rec = [p[0] for p in per]
    gaps = np.diff(sorted(set(rec)))
    cadence = max(1, int(meta.get("per_tensor_every") or (np.bincount(gaps).argmax()
                                                          if len(gaps) else 1)))
    logs = []
    for _, norms in per:
        sq = [[(norms.get(n) if norms.get(n) is not None else math.nan) for n in m]
              for m in members]
        logs.append(np.array([math.sqrt(sum(v * v for v in row)) for row in sq]))
    positive = [v for vals in logs for v in vals if v > 0 and math.isfinite(v)]
    floor = math.log10(min(positive)) - 0.5 if positive else 0.0  # where zero norms go
    for k, (step, vals) in enumerate(zip(rec, logs)):
        bad_row = ~np.isfinite(vals)
        # a record stands for the steps up to the next one at the usual cadence; a non-finite
        # one only for its own step
        end = step + 1 if bad_row.any() else min(
            rec[k + 1] if k + 1 < len(rec) else step + cadence, step + cadence)
        c0 = (step - lo) // width
        c1 = max((end - 1 - lo) // width, c0)
        with np.errstate(divide="ignore", invalid="ignore"):
            col = np.where(vals > 0, np.log10(vals), np.where(vals == 0, floor, np.nan))
        for c in range(c0, min(c1, cols - 1) + 1):
            arr[:, c] = col
            bad[:, c] = bad_row
    ax.set_facecolor("#d9d9d9")
    edges_x = lo - 0.5 + width * np.arange(cols + 1)
    edges_y = np.arange(len(labels) + 1) - 0.5
    im = ax.pcolormesh(edges_x, edges_y, np.ma.masked_invalid(arr), cmap="viridis")
    if bad.any():
        ax.pcolormesh(edges_x, edges_y, np.ma.masked_where(~bad, np.ones_like(arr)),
                      cmap=matplotlib_red(), vmin=0, vmax=1)
    ax.invert_yaxis()
    step = max(1, len(labels) // 30)
    ax.set_yticks(range(0, len(labels), step), labels[::step], fontsize=6)
    ax.figure.colorbar(im, cax=ax.inset_axes([1.01, 0.0, 0.015, 1.0]), label="log10 grad norm")
    what = "layer" if len(labels) < len(names) else "tensor"
    ax.set_title(f"per-{what} gradient norm (log10; darkest: zero, gray: not recorded, "
                 "red: NaN/Inf)")


def matplotlib_red():
    from matplotlib.colors import ListedColormap  # optional, as every plotting import here

    return ListedColormap(["#d62728"])


def _lr_scale_panel(ax, meta: dict, steps: list[dict], events: list[dict], xs: list[int]
                    ) -> None:
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


def figure(meta: dict, steps: list[dict], events: list[dict]):
    """The report's plots: the panels of PANELS that have something to show, one figure."""
    import matplotlib  # optional: `fasthealth report` without it writes the text summary

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    events = [e for e in events if is_step(e.get("step"))]  # the others are only listed
    xs = [r["step"] for r in steps]
    panels = [(p, h) for p, h, show in PANELS if show(meta, steps, events)]
    height = sum(h for _, h in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 1.45 * height + 1), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [h for _, h in panels]})
    for ax, (panel, _) in zip(axes[:, 0], panels):
        panel(ax, meta, steps, events, xs)
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=True)
    axes[-1, 0].set_xlabel("step")
    if xs:
        axes[0, 0].set_xlim(min(xs) - 1, max(xs) + 1)
    # the same margins for every panel, so that one step is one x position in all of them
    fig.subplots_adjust(left=0.17, right=0.80, top=1 - 0.45 / fig.get_figheight(),
                        bottom=0.5 / fig.get_figheight(), hspace=0.45)
    return fig


def write(log_dir: str | Path, out: str | Path | None = None) -> tuple[Path, str]:
    """Reads ``log_dir`` (``load``: problems warned) and writes report.html and report.png
    into ``out`` (default: ``log_dir``); returns report.html's path and the text summary."""
    return write_report(log_dir, *load(log_dir), out=out)


def write_report(log_dir: str | Path, meta: dict, steps: list[dict], events: list[dict],
                 out: str | Path | None = None) -> tuple[Path, str]:
    """``write`` for a log already read."""
    text = summary(meta, steps, events)
    out = Path(out) if out is not None else Path(log_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = figure(meta, steps, events)
    fig.savefig(out / "report.png", dpi=90)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt  # optional, as above; figure() imported it already

    plt.close(fig)
    img = base64.b64encode(buf.getvalue()).decode()
    rows = "\n".join(
        f"<tr><td>{html.escape(str(e['step']))}</td>"
        f"<td style='color:{EVENT_COLORS.get(e['kind'], 'gray')}'>"
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
        meta, steps, events, problems = read(args.log_dir)
    except (OSError, LogError) as exc:
        return _nothing_read(args.log_dir, exc)
    if problems.skipped or problems.marked:
        print(problems.text(args.log_dir), file=sys.stderr)
    try:  # an optional dependency: without it, the text summary only
        import matplotlib  # noqa: F401
    except ImportError:
        print(summary(meta, steps, events))
        print("fasthealth report: the plots and report.html need matplotlib: "
              "pip install 'fasthealth[report]' (or: pip install matplotlib)", file=sys.stderr)
        return 1
    out = args.out if args.out is not None else args.log_dir
    try:
        path, text = write_report(args.log_dir, meta, steps, events, out=out)
    except OSError as exc:
        print(f"fasthealth report: cannot write the report to {out}: {exc}", file=sys.stderr)
        return 1
    print(text)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
