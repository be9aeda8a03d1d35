"""Host-side detectors over per-step records: the rules a practitioner applies by eye.

They run at each Monitor flush over the records of the flushed steps, in step order, keeping
their state across flushes. Each returns ``(kind, message, details)`` tuples for one step.

Defaults and where the rules come from:

- spikes (``loss_spike``, ``grad_norm_spike``): z-score of the value against the mean and std of
  the last ``window`` finite, non-spike values, armed after ``warmup`` such values; a spike is
  not added to the window (OLMo-core's spike detection). Only upward spikes count.
- ``divergence``: a sustained upward trend: the median of the last 10 losses has stood more
  than ``ratio`` (50%) above the median of the ``window`` (50) losses before them for
  ``patience`` (5) steps, and a least-squares line through all 60 rises. Medians keep a lone
  spike from counting as a trend. Fires once, re-arms when the loss comes back.
- ``oscillation``: over the last ``window`` losses, at least ``alternation`` (80%) of successive
  differences change sign, their mean size exceeds ``amplitude`` (10%) of the mean loss, and the
  fitted slope does not fall by more than that size over the window: large swings, no progress.
- ``vanishing_grad``: the global gradient norm is below ``abs_threshold`` (1e-8), or more than
  ``rel_drop`` (1e4) times below the median of the recent finite norms, for ``patience`` (3)
  steps in a row.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

Found = tuple[str, str, dict]


class SpikeDetector:
    """z-score of a value against a window of recent finite, non-spike values."""

    def __init__(self, kind: str, label: str, zscore: float, window: int, warmup: int,
                 max_run: int = 5):
        self.kind, self.label = kind, label
        self.zscore, self.warmup, self.max_run = zscore, warmup, max_run
        self.values: deque[float] = deque(maxlen=window)
        self.run = 0

    def update(self, value: float) -> list[Found]:
        if not math.isfinite(value):
            return []
        found: list[Found] = []
        if self.run >= self.max_run:
            # A run of spikes is a new level, not a spike: accept it into the window and stay
            # quiet until the values are back in range.
            mean = statistics.fmean(self.values)
            std = statistics.pstdev(self.values)
            self.values.append(value)
            if not (std > 0 and (value - mean) / std > self.zscore):
                self.run = 0
            return found
        if len(self.values) >= max(self.warmup, 2):
            mean = statistics.fmean(self.values)
            std = statistics.pstdev(self.values)
            z = (value - mean) / std if std > 0 else (math.inf if value > mean else 0.0)
            if z > self.zscore:
                found.append((
                    self.kind,
                    f"{self.label} {value:.4g} is {z:.1f} std above its recent mean {mean:.4g}",
                    {"value": value, "zscore": z, "window_mean": mean, "window_std": std,
                     "window": len(self.values), "threshold": self.zscore},
                ))
                self.run += 1
                return found  # a spike stays out of the window
        self.run = 0
        self.values.append(value)
        return found


def _slope(ys: list[float]) -> float:
    n = len(ys)
    xm = (n - 1) / 2
    ym = statistics.fmean(ys)
    num = sum((i - xm) * (y - ym) for i, y in enumerate(ys))
    den = sum((i - xm) ** 2 for i in range(n))
    return num / den if den else 0.0


class DivergenceDetector:
    """A sustained rise: the median of the last ``short`` losses stands ``ratio`` above the
    median of the ``window`` losses before them for ``patience`` steps in a row, while a line
    fitted to those ``window + short`` losses rises. Medians keep lone spikes out of it."""

    def __init__(self, window: int = 50, ratio: float = 0.5, warmup: int = 20,
                 patience: int = 5, short: int = 10):
        self.ratio, self.warmup, self.patience, self.short = ratio, warmup, patience, short
        self.history: deque[float] = deque(maxlen=window + short)
        self.seen = 0
        self.above_for = 0
        self.active = False

    def update(self, loss: float) -> list[Found]:
        if not math.isfinite(loss):
            return []
        self.seen += 1
        self.history.append(loss)
        if self.seen <= self.warmup or len(self.history) < self.short + 10:
            return []
        values = list(self.history)
        recent = statistics.median(values[-self.short:])
        ref = statistics.median(values[:-self.short])
        above = recent > ref + self.ratio * abs(ref)
        self.above_for = self.above_for + 1 if above else 0
        if not above:
            self.active = False
            return []
        if self.above_for >= self.patience and not self.active and _slope(values) > 0:
            self.active = True
            rise = (recent / ref - 1) * 100 if ref > 0 else math.inf
            return [("divergence",
                     f"loss trending up: the median of the last {self.short} losses, "
                     f"{recent:.4g}, is {rise:.0f}% above the {len(values) - self.short} "
                     f"before them ({ref:.4g})",
                     {"median": recent, "reference_median": ref, "loss": loss})]
        return []


class OscillationDetector:
    def __init__(self, window: int = 20, alternation: float = 0.8, amplitude: float = 0.1,
                 warmup: int = 20):
        self.window, self.alternation, self.amplitude, self.warmup = (
            window, alternation, amplitude, warmup)
        self.recent: deque[float] = deque(maxlen=window)
        self.seen = 0
        self.active = False

    def update(self, loss: float) -> list[Found]:
        if not math.isfinite(loss):
            return []
        self.seen += 1
        self.recent.append(loss)
        if self.seen <= self.warmup or len(self.recent) < self.window:
            return []
        ys = list(self.recent)
        diffs = [b - a for a, b in zip(ys, ys[1:])]
        flips = sum(1 for a, b in zip(diffs, diffs[1:]) if a * b < 0) / (len(diffs) - 1)
        swing = statistics.fmean(abs(d) for d in diffs)
        level = abs(statistics.fmean(ys)) or 1.0
        drop = -_slope(ys) * (len(ys) - 1)
        oscillating = flips >= self.alternation and swing > self.amplitude * level and drop < swing
        if oscillating and not self.active:
            self.active = True
            return [("oscillation",
                     f"loss oscillating: {flips:.0%} of steps reverse direction, swings of "
                     f"{swing:.3g} ({swing / level:.0%} of the loss), no downward trend",
                     {"alternation": flips, "swing": swing, "mean_loss": level})]
        if not oscillating:
            self.active = False
        return []


class VanishingDetector:
    def __init__(self, abs_threshold: float = 1e-8, rel_drop: float = 1e4, patience: int = 3,
                 window: int = 128, warmup: int = 20):
        self.abs_threshold, self.rel_drop, self.patience = abs_threshold, rel_drop, patience
        self.norms: deque[float] = deque(maxlen=window)
        self.warmup = warmup
        self.low = 0
        self.active = False

    def update(self, norm: float) -> list[Found]:
        if not math.isfinite(norm):
            return []
        ref = statistics.median(self.norms) if len(self.norms) >= self.warmup else None
        low = norm < self.abs_threshold or (ref is not None and norm * self.rel_drop < ref)
        self.low = self.low + 1 if low else 0
        if not low:
            self.norms.append(norm)
            self.active = False
            return []
        if self.low >= self.patience and not self.active:
            self.active = True
            return [("vanishing_grad",
                     f"global gradient norm {norm:.3g} has been vanishingly small for "
                     f"{self.low} steps" + (f" (recent median {ref:.3g})" if ref else ""),
                     {"grad_norm": norm, "recent_median": ref, "steps": self.low})]
        return []
