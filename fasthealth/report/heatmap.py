"""The per-tensor heatmap's data: which steps were recorded, what each column stands for, and
its colour scale (drawn by ``plots.py``). numpy, an optional dependency (the report extra), is
imported inside the functions that use it."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .read import is_step


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


@dataclass
class Heatmap:
    """The per-tensor heatmap's data: one column per step whose per-tensor norms were recorded
    (``steps``, in order), standing for the steps from there up to ``ends`` (excluded).
    ``values`` (rows x columns) holds log10 of each row's norm (-inf for a zero norm), NaN
    where it is not finite, and ``bad`` marks those. ``quiet``: the column's record was taken
    at the usual cadence, at a step without events. ``unsampled``: the [start, end) runs of
    steps that were logged but no column stands for (after a record at an event, until the next
    record at the cadence): not missing data, only not sampled."""

    labels: list[str]
    members: list[list[str]]
    steps: list[int]
    ends: list[int]
    values: Any  # numpy arrays (numpy is imported only where the plots are drawn)
    bad: Any
    quiet: list[bool]
    cadence: int
    unsampled: list[tuple[int, int]] = field(default_factory=list)

    @property
    def by_layer(self) -> bool:
        return any(len(m) > 1 for m in self.members)



MAX_COLUMNS = 1500  # heatmap columns at most; past that, neighbouring records are combined


def heatmap_data(meta: dict, steps: list[dict], events: Sequence[dict] = (),
                 max_columns: int = MAX_COLUMNS) -> Heatmap:
    """The heatmap of the steps whose per-tensor norms were recorded, and only those: a Monitor
    records them every ``per_tensor_every`` steps and at every step with events. A record taken
    at the cadence, at a quiet step, stands for the steps up to the next record, at most the
    cadence; a record at a step with events (or with a non-finite norm) stands for its own step
    only: the spike it shows is not what the steps after it held, and they were not recorded
    (drawn gray). Past ``max_columns`` records, neighbouring ones are combined (the largest
    norm of each row, non-finite where any is)."""
    import numpy as np  # the plots' dependencies are optional (the report extra)

    eventful = {e["step"] for e in events if is_step(e.get("step"))}
    per = sorted(((r["step"], r["per_tensor_norms"], bool(r.get("events")) or r["step"] in
                   eventful) for r in steps if r.get("per_tensor_norms")), key=lambda p: p[0])
    # a null norm is a NaN/Inf one, except at a step whose gradients were all finite: there
    # the tensor had no gradient (a forgotten backward, a frozen branch): drawn gray, not red
    finite = {r["step"] for r in steps if r.get("grads_finite") is True}
    dedup: dict[int, tuple] = {}
    for p in per:  # a step logged twice (a reopened run): its last record
        dedup[p[0]] = p
    per = list(dedup.values())
    names = meta.get("names") or (list(per[0][1]) if per else [])
    labels, members = _heatmap_rows(names)
    rec = [p[0] for p in per]
    regular = [p[0] for p in per if not p[2]]
    gaps = np.diff(regular) if len(regular) > 1 else np.diff(rec)
    cadence = max(1, int(meta.get("per_tensor_every") or (np.bincount(gaps).argmax()
                                                          if len(gaps) else 1)))
    last = max(r["step"] for r in steps) + 1 if steps else 0
    vals = np.full((len(labels), len(per)), np.nan)
    absent = np.zeros(vals.shape, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for k, (step, norms, _) in enumerate(per):
            for i, m in enumerate(members):
                got = [norms.get(n) for n in m]
                if all(v is not None for v in got):
                    vals[i, k] = math.sqrt(sum(v * v for v in got))
                elif step in finite:
                    absent[i, k] = True
        bad = ~np.isfinite(vals) & ~absent
        logs = np.where(vals > 0, np.log10(np.where(vals > 0, vals, 1.0)),
                        np.where(vals == 0, -np.inf, np.nan))
    quiet, ends = [], []
    for k, (step, _, had_events) in enumerate(per):
        q = not had_events and not bad[:, k].any()
        nxt = rec[k + 1] if k + 1 < len(rec) else last
        quiet.append(q)
        ends.append(max(step + 1, min(nxt, step + cadence, max(last, step + 1))) if q
                    else step + 1)
    h = Heatmap(labels, members, rec, ends, logs, bad, quiet, cadence)
    h = _combined(h, max_columns) if len(rec) > max_columns else h
    return replace(h, unsampled=_unsampled(h, [r["step"] for r in steps]))


def _unsampled(h: Heatmap, logged: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of ``logged`` steps that no column of ``h`` stands for."""
    import numpy as np  # optional, as above

    xs = np.unique(np.array([s for s in logged if is_step(s)], dtype=np.int64))
    if not xs.size:
        return []
    k = np.searchsorted(np.array(h.steps, dtype=np.int64), xs, side="right") - 1
    ends = np.array(h.ends or [0], dtype=np.int64)
    covered = (k >= 0) & (xs < ends[np.maximum(k, 0)])
    out: list[tuple[int, int]] = []
    for x in xs[~covered].tolist():
        if out and out[-1][1] == x:
            out[-1] = (out[-1][0], x + 1)
        else:
            out.append((x, x + 1))
    return out


def _combined(h: Heatmap, max_columns: int) -> Heatmap:
    """``h`` with neighbouring columns combined into at most ``max_columns`` (by step)."""
    import numpy as np  # optional, as above

    lo, hi = h.steps[0], h.ends[-1]
    width = math.ceil((hi - lo) / max_columns)
    groups: dict[int, list[int]] = {}
    for k, s in enumerate(h.steps):
        groups.setdefault((s - lo) // width, []).append(k)
    cols = list(groups.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups stay NaN
        values = np.stack([np.nanmax(h.values[:, c], axis=1) for c in cols], axis=1)
    bad = np.stack([h.bad[:, c].any(axis=1) for c in cols], axis=1)
    values[bad] = np.nan
    return Heatmap(h.labels, h.members, [h.steps[c[0]] for c in cols],
                   [max(h.ends[k] for k in c) for c in cols], values, bad,
                   [all(h.quiet[k] for k in c) for c in cols], h.cadence)


def color_range(h: Heatmap, incidents: list[dict]) -> tuple[float, float]:
    """The heatmap's colour scale: from the smallest norm to a decade above the run's usual
    largest (the 99th percentile of the quiet records outside incidents), so that a run that
    blew up by 20 decades still shows a one-step spike; larger norms saturate."""
    import numpy as np  # optional, as above

    finite = np.isfinite(h.values)
    if not finite.any():
        return 0.0, 1.0
    lo, top = float(h.values[finite].min()), float(h.values[finite].max())
    order = sorted(incidents, key=lambda i: i["start"])
    starts = np.array([i["start"] for i in order])
    reach = np.maximum.accumulate([i["end"] for i in order]) if order else np.array([])
    at = np.searchsorted(starts, h.steps, side="right") - 1  # the last to start at or before
    inside = [k >= 0 and reach[k] >= s for k, s in zip(at, h.steps)]
    usual = [k for k, (q, x) in enumerate(zip(h.quiet, inside)) if q and not x]
    base = h.values[:, usual][finite[:, usual]] if usual else np.array([])
    hi = top if not base.size else min(top, float(np.percentile(base, 99)) + 1.0)
    return lo, max(hi, lo + 1e-3)


