"""Every event rule of the monitor, behind one interface: the rules a practitioner applies by eye.

A ``Detector`` observes the host record of each step (``record.HostStep``), in step order at
each Monitor flush, keeps its own state across flushes, and returns ``(kind, message, details)``
tuples for that step. ``default_detectors`` builds the Monitor's set, in reporting order:
``nonfinite_loss``, ``nonfinite_grad``, ``loss_spike``, ``divergence``, ``oscillation``,
``grad_norm_spike``, ``vanishing_grad``, ``optimizer_state_nonfinite``, ``loss_scale_collapse``.

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

from .record import HostStep

Found = tuple[str, str, dict]


class Detector:
    """One event rule."""

    def observe(self, s: HostStep) -> list[Found]:
        raise NotImplementedError


def _skipped(s: HostStep) -> bool:
    return s.values["skipped"] > 0


class NonFiniteLossDetector(Detector):
    def observe(self, s: HostStep) -> list[Found]:
        v = s.values
        if v["loss_finite"]:
            return []
        action = " (step skipped)" if _skipped(s) else ""
        return [("nonfinite_loss", f"loss is {v['loss']}{action}",
                 {"loss": v["loss"], "skipped": _skipped(s)})]


class NonFiniteGradDetector(Detector):
    """Names the tensors whose gradients hold NaN/Inf (the first five in the message)."""

    def __init__(self, names: list[str]):
        self.names = names

    def observe(self, s: HostStep) -> list[Found]:
        v = s.values
        if v["grads_finite"]:
            return []
        bad = {self.names[i]: int(c) for i, c in enumerate(s.per_bad) if c == c and c > 0}
        shown = ", ".join(list(bad)[:5]) + (" ..." if len(bad) > 5 else "")
        action = " (step skipped)" if _skipped(s) else ""
        return [("nonfinite_grad",
                 f"{int(v['nan_count'])} NaN and {int(v['inf_count'])} Inf gradient values in "
                 f"{len(bad)} tensor(s): {shown}{action}",
                 {"tensors": bad, "nan_count": int(v["nan_count"]),
                  "inf_count": int(v["inf_count"]), "skipped": _skipped(s)})]


class SpikeDetector(Detector):
    """z-score of a value (the step's ``field``) against a window of recent finite, non-spike
    values; with ``finite_grads_only`` steps with non-finite gradients are not looked at."""

    def __init__(self, kind: str, label: str, zscore: float, window: int, warmup: int,
                 max_run: int = 5, field: str = "loss", finite_grads_only: bool = False):
        self.kind, self.label = kind, label
        self.field, self.finite_grads_only = field, finite_grads_only
        self.zscore, self.warmup, self.max_run = zscore, warmup, max_run
        self.values: deque[float] = deque(maxlen=window)
        self.run = 0

    def observe(self, s: HostStep) -> list[Found]:
        if self.finite_grads_only and not s.values["grads_finite"]:
            return []
        return self.update(s.values[self.field])

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


class LossTrendDetector(Detector):
    """Base of the rules over a window of recent finite losses: ``judge`` runs once the window
    holds ``min_len`` losses and more than ``warmup`` have been seen."""

    def __init__(self, maxlen: int, min_len: int, warmup: int):
        self.history: deque[float] = deque(maxlen=maxlen)
        self.min_len, self.warmup = min_len, warmup
        self.seen = 0
        self.active = False

    def observe(self, s: HostStep) -> list[Found]:
        return self.update(s.values["loss"])

    def update(self, loss: float) -> list[Found]:
        if not math.isfinite(loss):
            return []
        self.seen += 1
        self.history.append(loss)
        if self.seen <= self.warmup or len(self.history) < self.min_len:
            return []
        return self.judge(list(self.history), loss)

    def judge(self, values: list[float], loss: float) -> list[Found]:
        raise NotImplementedError


class DivergenceDetector(LossTrendDetector):
    """A sustained rise: the median of the last ``short`` losses stands ``ratio`` above the
    median of the ``window`` losses before them for ``patience`` steps in a row, while a line
    fitted to those ``window + short`` losses rises. Medians keep lone spikes out of it."""

    def __init__(self, window: int = 50, ratio: float = 0.5, warmup: int = 20,
                 patience: int = 5, short: int = 10):
        super().__init__(window + short, short + 10, warmup)
        self.ratio, self.patience, self.short = ratio, patience, short
        self.above_for = 0

    def judge(self, values: list[float], loss: float) -> list[Found]:
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


class OscillationDetector(LossTrendDetector):
    def __init__(self, window: int = 20, alternation: float = 0.8, amplitude: float = 0.1,
                 warmup: int = 20):
        super().__init__(window, window, warmup)
        self.alternation, self.amplitude = alternation, amplitude

    def judge(self, ys: list[float], loss: float) -> list[Found]:
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


class VanishingDetector(Detector):
    def __init__(self, abs_threshold: float = 1e-8, rel_drop: float = 1e4, patience: int = 3,
                 window: int = 128, warmup: int = 20):
        self.abs_threshold, self.rel_drop, self.patience = abs_threshold, rel_drop, patience
        self.norms: deque[float] = deque(maxlen=window)
        self.warmup = warmup
        self.low = 0
        self.active = False

    def observe(self, s: HostStep) -> list[Found]:
        return self.update(s.values["grad_norm"]) if s.values["grads_finite"] else []

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


class OptimizerStateDetector(Detector):
    """NaN/Inf in the optimizer's state, reported once until a later scan finds it clean."""

    def __init__(self) -> None:
        self.bad = False

    def observe(self, s: HostStep) -> list[Found]:
        count = s.values["optimizer_nonfinite"]
        if count != count:  # not scanned this step
            return []
        if count == 0:
            self.bad = False
            return []
        if self.bad:
            return []
        self.bad = True
        stats = s.info.get("opt_stats")
        names = stats.nonfinite() if stats is not None else []
        return [("optimizer_state_nonfinite",
                 f"{int(count)} NaN/Inf values in optimizer state: "
                 + ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
                 {"tensors": names, "count": int(count)})]


class LossScaleDetector(Detector):
    """A GradScaler's scale below ``min_loss_scale`` or NaN, reported when it falls."""

    def __init__(self, min_loss_scale: float) -> None:
        self.min_loss_scale = min_loss_scale
        self.collapsed = False

    def observe(self, s: HostStep) -> list[Found]:
        scale = s.values["loss_scale"]
        collapsed = not math.isfinite(scale) or scale < self.min_loss_scale
        fell, self.collapsed = collapsed and not self.collapsed, collapsed
        if not fell:
            return []
        return [("loss_scale_collapse",
                 f"GradScaler scale fell to {scale:.3g} (below {self.min_loss_scale:g}): fp16 "
                 "gradients are overflowing step after step",
                 {"scale": scale, "min_loss_scale": self.min_loss_scale})]


def default_detectors(names: list[str], *, spike_zscore: float, spike_window: int,
                      warmup_steps: int, vanishing_threshold: float,
                      min_loss_scale: float | None) -> list[Detector]:
    """The Monitor's rules in reporting order; the loss-scale rule only with a GradScaler
    (``min_loss_scale`` not None)."""
    found: list[Detector] = [
        NonFiniteLossDetector(),
        NonFiniteGradDetector(names),
        SpikeDetector("loss_spike", "loss", spike_zscore, spike_window, warmup_steps),
        DivergenceDetector(warmup=warmup_steps),
        OscillationDetector(warmup=warmup_steps),
        SpikeDetector("grad_norm_spike", "global grad norm", spike_zscore, spike_window,
                      warmup_steps, field="grad_norm", finite_grads_only=True),
        VanishingDetector(abs_threshold=vanishing_threshold, window=spike_window,
                          warmup=warmup_steps),
        OptimizerStateDetector(),
    ]
    if min_loss_scale is not None:
        found.append(LossScaleDetector(min_loss_scale))
    return found
