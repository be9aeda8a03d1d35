"""Every event rule of the monitor, behind one interface: the rules a practitioner applies by eye.

A ``Detector`` observes the host record of each step (``record.HostStep``), in step order at
each Monitor flush, keeps its own state across flushes, and returns ``(kind, message, details)``
tuples for that step. ``default_detectors`` builds the Monitor's set, in reporting order.
Every message says what was seen and what to check first.

The rules are calibrated on the corpus of ``bench/detectors/`` (healthy runs of ten kinds and
thirteen faults; ``python bench/bench_detectors.py``): at the defaults they raise no event on
the calibration runs, and the held-out runs say how well that carries over (README). What makes
that possible: losses and gradient norms are judged against robust statistics of their own
recent history: the median of the last 32 values, and a *noise unit*: the 90th percentile of
the window's step-to-step differences over 1.645 * sqrt(2) (the standard deviation, were the
noise normal). Minibatch noise is heavy-tailed: a mean and a standard deviation were too narrow
at a noisy loss floor (false alarms) and, over a window that still held a long descent, far
too wide to see a garbage batch; differences leave the trend out.

- ``loss_spike``, ``grad_norm_spike``: a value more than ``zscore`` (6) noise units above the
  recent median, the noise measured over the last ``window`` (128) finite, non-spike values
  (or over the last 32, when they are noisier; at least ``MIN_LOG_NOISE`` on the log scale),
  after ``warmup`` (20) of them,
  on the linear and the log scale both (near a loss floor of 0.01 healthy batches reach 50x the
  median: far on the log scale, near on the linear one); or more than ``extreme`` (5) times
  that on the linear scale with half of it on the log one (at such a floor a batch 400x the
  level, mislabelled, is hundreds of linear noise units out but only ~5 log ones; healthy
  batches never passed 11 linear units in the corpus); or the loss and the gradient norm of a
  step both above ``joint`` (0.85) of the threshold (a bad batch moves both); or 3 steps in a
  row above 0.6 of it (a level shift). Before the window is armed, a loss above 4x or a
  gradient norm above 100x their first values (an LR far too high from the start). 5 spikes in
  a row: a new level.
- ``divergence``: the log-loss rises steadily: a line through the last 40 losses climbs with a
  t-statistic above 5 and by more than 20%, and the recent median stands 20% above the best
  median seen so far.
- ``lr_jump``: the learning rate (the optimizer's first group) more than 3x the highest it has
  been, after ``warmup`` steps: the cause, read off at the step, before the loss shows it (an
  LR jump that moves the loss 5% is otherwise seen only late, or not at all); or more than 3x
  the highest it had been when it last stopped rising (a ramp of 10% a step, caught after 12).
- ``oscillation``: over the last 32 losses, deviations from the trend alternate (lag-1
  autocorrelation below -0.8), the swings are 3x the run's usual ones, and the loss does not
  trend down. Minibatch noise goes up and down too, but with the swings of its own past.
- ``vanishing_grad``: the global norm below ``abs_threshold`` (1e-8) or 1e4 times below its
  recent median for 3 steps; or some tensors' gradients below 1e-3 of their own recent level
  (an exponential average of the log norm) for 3 steps (dead ReLUs, saturated sigmoids).
- ``exploding_grad``: a tensor's gradient norm above 100x its own recent level; or the global
  gradient norm climbing steadily several-fold (the divergence rule on the log norm over 24
  steps, t above 6, 3.5x): weights growing without bound. A notice, and an alarm once the loss
  stands 10% above both its best and its level when the climb began, unless the learning rate
  climbed 2x with it (a warm-up, a warm restart).
- ``nonfinite_loss``, ``nonfinite_grad``: at the step itself. Under a ``GradScaler`` an overflow
  step (finite loss, Inf but no NaN in the gradients, skipped by the scaler) is the scaler at
  work, not an event: ``loss_scale_collapse`` reports the scale below ``min_loss_scale``, or
  down 8x within 10 steps (three back-offs: the overflow persists).
- ``stall``: a run that does not learn from the start, judged at step 100: tensors whose
  gradients stay below 1e-5 of the largest while the loss has not halved; names them.
- ``optimizer_state_nonfinite``: NaN/Inf in the optimizer's state at a scan.
- ``replica_divergence``: under a process group, ranks whose replicas disagree
  (``fasthealth.distributed``), named.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from ..stats import decode_ranks
from .record import HostStep

Found = tuple[str, str, dict]

NOISE_QUANTILE = 0.9
NOISE_PER_SIGMA = 1.6449  # the 90th percentile of |N(0, 1)|
MIN_LOG_NOISE = 0.005  # the smallest noise unit on the log scale (spike_scores)


class Detector:
    """One event rule."""

    def observe(self, s: HostStep) -> list[Found]:
        raise NotImplementedError


def _listed(names) -> str:
    """The first five names, and "..." when there are more."""
    names = list(names)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def _skipped(s: HostStep) -> bool:
    return s.values["skipped"] > 0


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _slope_t(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys against 0..n-1, and its t-statistic."""
    n = len(ys)
    xm = (n - 1) / 2
    ym = statistics.fmean(ys)
    sxx = sum((i - xm) ** 2 for i in range(n))
    slope = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sxx
    resid = sum((y - ym - slope * (i - xm)) ** 2 for i, y in enumerate(ys))
    se = math.sqrt(resid / max(n - 2, 1) / sxx)
    return slope, (slope / se if se > 0 else (math.inf if slope > 0 else 0.0))


class NonFiniteLossDetector(Detector):
    def observe(self, s: HostStep) -> list[Found]:
        v = s.values
        if v["loss_finite"]:
            return []
        action = " (step skipped)" if _skipped(s) else ""
        return [("nonfinite_loss",
                 f"loss is {v['loss']}{action}. Check first: the batch (fh.replay on this "
                 "event's dump says whether it reproduces and which module made the first "
                 "NaN/Inf), then the loss function's logs, divisions and masks",
                 {"loss": v["loss"], "skipped": _skipped(s)})]


class NonFiniteGradDetector(Detector):
    """Names the tensors whose gradients hold NaN/Inf (the first five in the message). With a
    GradScaler, overflow steps (a finite loss, Inf but no NaN in the gradients, skipped) are the
    scaler at work and left to ``LossScaleDetector``; a NaN is always reported."""

    def __init__(self, names: list[str], scaler: bool = False):
        self.names, self.scaler = names, scaler

    def observe(self, s: HostStep) -> list[Found]:
        v = s.values
        overflow = self.scaler and v["loss_finite"] and v["nan_count"] == 0 and _skipped(s)
        if v["grads_finite"] or overflow:
            return []
        bad = {self.names[i]: int(c) for i, c in enumerate(s.per_bad) if c == c and c > 0}
        shown = _listed(bad)
        action = " (step skipped)" if _skipped(s) else ""
        return [("nonfinite_grad",
                 f"{int(v['nan_count'])} NaN and {int(v['inf_count'])} Inf gradient values in "
                 f"{len(bad)} tensor(s): {shown}{action}. Check first: whether the loss was "
                 "finite (if so, the backward pass of the first tensor named made it: "
                 "fh.replay names the module), then fp16 ranges",
                 {"tensors": bad, "nan_count": int(v["nan_count"]),
                  "inf_count": int(v["inf_count"]), "skipped": _skipped(s)})]


def _noise_unit(values: list[float]) -> float:
    diffs = [abs(b - a) for a, b in zip(values, values[1:])]
    return _quantile(diffs, NOISE_QUANTILE) / (NOISE_PER_SIGMA * math.sqrt(2)) if diffs else 0.0


def level_and_noise(values: list[float], recent: int = 32) -> tuple[float, float]:
    """(the median of the last ``recent`` values, the noise unit of the step-to-step
    differences: their 90th percentile over 1.645 * sqrt(2), over the whole window or over its
    last ``recent`` values, whichever is larger). Differences leave a steady trend out of the
    noise, and the recent median follows it, so a loss still falling widens neither (over a
    window that still held a long descent, deviations from one median were 10x the minibatch
    noise: a loss 50x its level went unseen). The recent noise counts when the run has become
    noisier than its window: a classifier that leaves a flat plateau for a fast, noisy descent
    would otherwise have that descent's ordinary swings judged against the plateau's noise
    (docs/performance.md, "Detector accuracy")."""
    noise = max(_noise_unit(values), _noise_unit(values[-recent:]))
    return statistics.median(values[-recent:]), noise


def spike_scores(values: list[float], x: float) -> tuple[float, float]:
    """How far ``x`` stands above the recent level of ``values``, in noise units, on the linear
    and on the log scale (the log one only when every value is positive, else equal to the
    linear one). On the log scale the noise unit is at least ``MIN_LOG_NOISE``: at a plateau
    whose losses barely differ step to step, a bump of a percent or two would otherwise score
    as a spike, though no user would act on it; with the floor a spike stands at least 3% above
    the level (6 units of 0.005)."""
    def z(vs: list[float], v: float, floor: float = 0.0) -> float:
        level, noise = level_and_noise(vs)
        noise = max(noise, floor)
        return (v - level) / noise if noise > 0 else (math.inf if v > level else 0.0)

    lin = z(values, x)
    if x > 0 and min(values) > 0:
        return lin, z([math.log(v) for v in values], math.log(x), MIN_LOG_NOISE)
    return lin, lin


def spike_score(values: list[float], x: float) -> float:
    """The smaller of ``spike_scores``: a spike must stand out on both scales."""
    return min(spike_scores(values, x))


class _Series:
    """One watched series of a ``SpikeDetector``: its window of finite, non-spike values, its
    first values, and its run of spikes."""

    def __init__(self, label: str, window: int, early_ratio: float, advice: str):
        self.label, self.early_ratio, self.advice = label, early_ratio, advice
        self.values: deque[float] = deque(maxlen=window)
        self.first: list[float] = []
        self.run = 0
        self.high = 0  # steps in a row above the shift threshold
        self.shifted = False

    def score(self, value: float, warmup: int) -> tuple[float, float] | None:
        """The linear and log spike scores of ``value``; None while the window is not armed (or
        no value)."""
        if not math.isfinite(value):
            return None
        if len(self.first) < 5:
            self.first.append(value)
        if len(self.values) < max(warmup, 3):
            return None
        return spike_scores(list(self.values), value)

    def early(self, value: float) -> float | None:
        """value / the largest of its first values, when that exceeds ``early_ratio`` (no window
        needed). The largest, not the median: at a batch of 8, healthy batches' losses spread
        several-fold, and the first few values are all there is to measure that spread on."""
        ref = max(self.first) if self.first else math.nan
        if math.isfinite(value) and ref > 0 and value > self.early_ratio * ref:
            return value / ref
        return None

    def settle(self, value: float, spike: bool, max_run: int) -> bool:
        """Takes ``value`` into the window unless it is a spike; a run of ``max_run`` spikes is a
        new level, taken in. Returns whether to report ``value`` as a spike."""
        if not math.isfinite(value):
            return False
        if not spike:
            self.run = 0
            self.values.append(value)
            return False
        if self.run >= max_run:
            self.values.append(value)
            return False
        self.run += 1
        return True


class SpikeDetector(Detector):
    """``loss_spike`` and ``grad_norm_spike``; see the module docstring. A value is a spike
    when its score exceeds ``zscore``, or when the loss and the gradient norm of the same step
    both exceed ``joint`` times it (a bad batch moves both), or, before the windows are armed,
    when it exceeds its first values ``early_ratio`` times."""

    ADVICE = {
        "loss": "Check first: this step's batch (its dump: fh.replay) for corrupt, mislabelled or "
                "out-of-distribution samples",
        "grad_norm": "Check first: this step's batch, then the learning rate; clipping "
                     "(max_grad_norm) bounds the damage",
    }

    def __init__(self, zscore: float = 6.0, window: int = 128, warmup: int = 20,
                 joint: float = 0.85, shift: float = 0.6, shift_steps: int = 3,
                 max_run: int = 5, early_loss: float = 4.0, early_grad_norm: float = 100.0,
                 extreme: float = 5.0):
        self.zscore, self.joint, self.warmup, self.max_run = zscore, joint, warmup, max_run
        self.extreme = extreme
        self.shift, self.shift_steps = shift, shift_steps
        self.series = {
            "loss": _Series("loss", window, early_loss, self.ADVICE["loss"]),
            "grad_norm": _Series("global grad norm", window, early_grad_norm,
                                 self.ADVICE["grad_norm"]),
        }

    def observe(self, s: HostStep) -> list[Found]:
        values = {"loss": s.values["loss"],
                  "grad_norm": s.values["grad_norm"] if s.values["grads_finite"] else math.nan}
        scores = {k: self.series[k].score(v, self.warmup) for k, v in values.items()}
        z = {k: None if x is None else min(x) for k, x in scores.items()}
        both = all(x is not None and x > self.joint * self.zscore for x in z.values())
        found = []
        for key, ser in self.series.items():
            v, zk = values[key], z[key]
            if zk is None:
                ratio = ser.early(v) if math.isfinite(v) else None
                if ratio is not None:
                    found.append(self._early(key, ser, v, ratio))
                elif math.isfinite(v) and len(ser.values) < max(self.warmup, 3):
                    ser.values.append(v)
                continue
            pair = scores[key]
            assert pair is not None  # zk is not None
            lin, log = pair
            extreme = lin > self.extreme * self.zscore and log > self.zscore / 2
            if ser.settle(v, zk > self.zscore or both or extreme, self.max_run):
                found.append(self._spike(key, ser, v, max(zk, lin) if extreme else zk, both))
            elif self._shifted(ser, zk):
                found.append(self._shift(key, ser, v, zk))
        return found

    def _shifted(self, ser: _Series, z: float) -> bool:
        """``shift_steps`` steps in a row above ``shift`` times the threshold: a new level,
        reported once until the series comes back."""
        ser.high = ser.high + 1 if z > self.shift * self.zscore else 0
        if ser.high == 0:
            ser.shifted = False
        if ser.high >= self.shift_steps and not ser.shifted:
            ser.shifted = True
            return True
        return False

    def _shift(self, key: str, ser: _Series, value: float, z: float) -> Found:
        median = statistics.median(ser.values)
        return (f"{key}_spike",
                f"{ser.label} stepped up and stayed: {ser.high} steps in a row more than "
                f"{self.shift * self.zscore:.1f} noise units above its recent median "
                f"{median:.4g} (now {value:.4g}). Check first: a change of learning rate "
                f"(schedule, a restart), then a change in the data. {ser.advice}",
                {"value": value, "zscore": z, "window_median": median, "steps": ser.high,
                 "threshold": self.shift * self.zscore, "shift": True})

    def _spike(self, key: str, ser: _Series, value: float, z: float, both: bool) -> Found:
        median = statistics.median(ser.values)
        ratio = f" ({value / median:.3g}x)" if median > 0 else ""
        joint = (" (the loss and the gradient norm jumped together)"
                 if both and not z > self.zscore else "")
        return (f"{key}_spike",
                f"{ser.label} {value:.4g} is {z:.1f} noise units above its recent median "
                f"{median:.4g}{ratio}{joint}. {ser.advice}",
                {"value": value, "zscore": z, "window_median": median,
                 "window": len(ser.values), "threshold": self.zscore, "joint": both})

    def _early(self, key: str, ser: _Series, value: float, ratio: float) -> Found:
        return (f"{key}_spike",
                f"{ser.label} {value:.4g} is {ratio:.3g}x its first values early in training. "
                "Check first: the learning rate and its warm-up (far too high from the "
                f"start?), then the initialisation. {ser.advice}",
                {"value": value, "ratio": ratio, "threshold": ser.early_ratio, "early": True})


class LossTrendDetector(Detector):
    """Base of the rules over a window of recent finite log-losses: ``judge`` runs once the
    window holds ``min_len`` values and more than ``warmup`` have been seen."""

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
        self.history.append(math.log(loss) if loss > 0 else math.nan)
        if self.seen <= self.warmup or len(self.history) < self.min_len:
            return []
        ys = list(self.history)
        if any(y != y for y in ys):  # a loss <= 0: no log scale to judge trends on
            return []
        return self.judge(ys, loss)

    def judge(self, ys: list[float], loss: float) -> list[Found]:
        raise NotImplementedError

    def once(self, found: Found) -> list[Found]:
        """``found``, the first time in an episode (until ``active`` is cleared)."""
        if self.active:
            return []
        self.active = True
        return [found]


class DivergenceDetector(LossTrendDetector):
    """A steady rise of the log-loss; see the module docstring."""

    def __init__(self, window: int = 40, t_min: float = 5.0, rise: float = 0.2,
                 warmup: int = 20, short: int = 10):
        super().__init__(window, window, warmup)
        self.t_min, self.rise, self.short = t_min, rise, short
        self.best = math.inf  # lowest median of `short` values seen

    def rising(self, ys: list[float]) -> tuple[float, float, float, float] | None:
        """(slope a step, its t, total rise over the window, rise above the best) when the
        window climbs by the rules, else None (and the episode ends once it is back down)."""
        recent = statistics.median(ys[-self.short:])
        self.best = min(self.best, recent)
        slope, t = _slope_t(ys)
        total = math.expm1(slope * (len(ys) - 1))
        above = math.expm1(recent - self.best)
        if t > self.t_min and total > self.rise and above > self.rise:
            return slope, t, total, above
        if above < self.rise / 2:
            self.active = False
        return None

    def judge(self, ys: list[float], value: float) -> list[Found]:
        found = self.rising(ys)
        if found is None:
            return []
        slope, t, total, above = found
        trend = {"slope_per_step": math.expm1(slope), "t": t, "rise": total,
                 "above_best": above, "best": math.exp(self.best)}
        return self.once(self.finding(trend, len(ys), value))

    def finding(self, trend: dict, window: int, loss: float) -> Found:
        return ("divergence",
                f"loss rising steadily: {trend['slope_per_step']:+.1%} a step over the last "
                f"{window} steps (t = {trend['t']:.1f}), {trend['above_best']:.0%} above its "
                f"best ({trend['best']:.4g}). Check first: the learning rate (schedule, "
                "warm-up end), then the data stream (a shift in what the batches hold), then "
                "the optimizer state", {**trend, "loss": loss})


class GradNormTrendDetector(DivergenceDetector):
    """The global gradient norm climbing steadily, several-fold (``exploding_grad``): weights
    growing without bound show there long before the loss moves. The divergence rule on the
    log of the norm, with a stricter t (``t_min`` 6) and a larger rise (``rise`` 2.5: 3.5x over
    the window and above the lowest level seen): early in training healthy norms climb 2-3x.

    A notice while the loss is fine (a growing norm with the loss still falling is how many
    healthy runs leave a plateau); an alarm when the loss confirms it: the median of the last
    ``short`` losses stands ``confirm`` (10%) above both the lowest such median and the median
    the loss had when the climb began (the ``short`` losses before the window's first step), at
    the finding or later in the same episode (then reported once more, as the alarm). Against
    the best alone, a run leaving its plateau would confirm its own healthy climb: its loss
    falls fast while the norm grows several-fold, and a noisy stretch of that descent stands
    above the best it reached on the way down, yet far below where the climb began
    (docs/performance.md, "Detector accuracy"). Never an alarm
    in an episode whose climb came with the learning rate's: at the finding, the rate stood
    ``lr_rise`` (2x) above its lowest over the window and the ``short`` steps before it: a
    warm-up or a warm restart raises the norm and the loss by design (a rate above its old peak
    is ``lr_jump``'s to judge)."""

    def __init__(self, window: int = 24, t_min: float = 6.0, rise: float = 2.5,
                 warmup: int = 20, short: int = 10, confirm: float = 0.1,
                 lr_rise: float = 2.0):
        super().__init__(window, t_min, rise, warmup, short)
        self.confirm, self.lr_rise = confirm, lr_rise
        self.losses: deque[float] = deque(maxlen=short)
        # the losses of the window's steps and of the ``short`` before it
        self.window_losses: deque[float] = deque(maxlen=window + short)
        self.best_loss = math.inf
        self.climb_start = math.inf  # the loss median when the episode's climb began
        self.lrs: deque[float] = deque(maxlen=window + short)
        self.lr_climb = False  # the learning rate rose lr_rise-fold with the episode's climb
        self.unconfirmed: Found | None = None  # the episode's notice, until the loss confirms

    def observe(self, s: HostStep) -> list[Found]:
        loss = s.values["loss"]
        lr = s.info.get("lr")
        if isinstance(lr, (int, float)) and lr > 0:
            self.lrs.append(float(lr))
        if math.isfinite(loss):
            self.losses.append(loss)
            self.window_losses.append(loss)
            if len(self.losses) == self.losses.maxlen:
                self.best_loss = min(self.best_loss, statistics.median(self.losses))
        if not s.values["grads_finite"]:
            return []
        was_active = self.active
        found = self.update(s.values["grad_norm"])
        if not self.active:
            self.unconfirmed = None
        if found:
            if not was_active:
                before = list(self.window_losses)[:self.losses.maxlen or 1]
                self.climb_start = statistics.median(before) if before else math.inf
                self.lr_climb = bool(self.lrs) and self.lrs[-1] > self.lr_rise * min(self.lrs)
            self.unconfirmed = None if self._confirmed() else found[0]
            return [self._as_alarm(f) if self.unconfirmed is None else f for f in found]
        if self.unconfirmed is not None and self._confirmed():
            confirmed, self.unconfirmed = self._as_alarm(self.unconfirmed), None
            return [confirmed]
        return []

    def _confirmed(self) -> bool:
        if len(self.losses) < (self.losses.maxlen or 1) or not math.isfinite(self.best_loss):
            return False
        if self.lr_climb:
            return False  # the schedule's doing: a warm-up, a warm restart (lr_jump judges it)
        ref = max(self.best_loss, self.climb_start if math.isfinite(self.climb_start) else 0.0)
        return statistics.median(self.losses) > (1 + self.confirm) * ref

    def _as_alarm(self, found: Found) -> Found:
        kind, message, details = found
        return (kind, message + ". The loss confirms it: its recent median stands "
                f"{self.confirm:.0%} or more above its best and above where it was when the "
                "climb began",
                {**details, "severity": "alarm", "loss_confirms": True,
                 "loss_at_climb_start": self.climb_start})

    def finding(self, trend: dict, window: int, norm: float) -> Found:
        return ("exploding_grad",
                f"global gradient norm climbing steadily: {trend['slope_per_step']:+.1%} a "
                f"step, {trend['rise'] + 1:.2g}x over the last {window} steps (t = "
                f"{trend['t']:.1f}), now {norm:.3g} against a low of {trend['best']:.3g}. Check "
                "first: the weights (check_params: a layer growing without bound, weight decay "
                "off or negative), then the learning rate, then clipping (max_grad_norm)",
                {**trend, "grad_norm": norm})


class LRJumpDetector(Detector):
    """The learning rate more than ``ratio`` (3) times the highest it has been, after
    ``warmup`` steps (``lr_jump``): a schedule stepped at the wrong rate, a resumed run with
    another configuration, a hand edit. Warm-ups climb a few percent a step and restarts
    (SGDR, cycles) return to the old peak, never 3x above it.

    A climb is judged as a whole: the learning rate more than ``ratio`` times the highest it
    had been when it last stopped rising (a step at or below the one before, after ``warmup``
    steps), reported once per climb: a schedule whose exponent changed sign grows 10% a step
    and never jumps 3x at once. A warm-up from the first step has no such point, so it is
    judged step by step only."""

    def __init__(self, ratio: float = 3.0, warmup: int = 20):
        self.ratio, self.warmup = ratio, warmup
        self.peak = 0.0
        self.last: float | None = None
        self.settled: float | None = None  # the peak when the rate last stopped rising
        self.since = 0  # steps it has risen since
        self.seen = 0

    def observe(self, s: HostStep) -> list[Found]:
        lr = s.info.get("lr")
        if lr is None or not math.isfinite(lr):
            return []
        self.seen += 1
        peak, self.peak = self.peak, max(self.peak, lr)
        rose = self.last is not None and lr > self.last
        self.last = lr
        if self.seen > self.warmup and not rose:
            self.settled, self.since = self.peak, 0
        elif rose:
            self.since += 1
        if self.seen <= self.warmup:
            return []
        if peak > 0 and lr > self.ratio * peak:
            ref, how = peak, f"the highest it had been ({peak:.4g})"
        elif self.settled is not None and self.settled > 0 and lr > self.ratio * self.settled:
            ref = self.settled
            how = (f"the highest it had been ({ref:.4g}) before it began climbing "
                   f"{self.since} steps ago")
        else:
            return []
        self.settled = None  # this climb is reported; the next starts where it stops
        return [("lr_jump",
                 f"learning rate {lr:.4g} is {lr / ref:.3g}x {how}. "
                 "Check first: the scheduler (stepped per batch instead of per epoch? a resumed "
                 "scheduler state? a growth factor above 1?), then the run's configuration; if "
                 "the change is intended, watch the loss and gradient norm over the next steps",
                 {"lr": lr, "previous_peak": ref, "ratio": lr / ref, "climb_steps": self.since})]


class OscillationDetector(LossTrendDetector):
    """Swings that alternate and exceed the run's own noise; see the module docstring."""

    def __init__(self, window: int = 32, autocorr: float = -0.8, amplitude: float = 3.0,
                 warmup: int = 20, history: int = 512):
        super().__init__(window, window, warmup)
        self.autocorr, self.amplitude = autocorr, amplitude
        self.swings: deque[float] = deque(maxlen=history)

    def judge(self, ys: list[float], loss: float) -> list[Found]:
        n = len(ys)
        slope, _ = _slope_t(ys)
        xm, ym = (n - 1) / 2, statistics.fmean(ys)
        r = [y - ym - slope * (i - xm) for i, y in enumerate(ys)]
        var = sum(x * x for x in r)
        rho = sum(a * b for a, b in zip(r, r[1:])) / var if var > 0 else 0.0
        swing = statistics.fmean(abs(b - a) for a, b in zip(ys, ys[1:]))
        ref = statistics.median(self.swings) if len(self.swings) >= n else None
        self.swings.append(swing)
        oscillating = (ref is not None and rho < self.autocorr
                       and swing > self.amplitude * ref and -slope * (n - 1) < swing)
        if not oscillating or ref is None:
            self.active = False
            return []
        return self.once(("oscillation",
                 f"loss oscillating: successive steps alternate (autocorrelation {rho:.2f}), "
                 f"swings of {math.expm1(swing):.0%} a step, {swing / ref:.1f}x the run's usual "
                 "minibatch noise, and no downward trend. Check first: the learning rate (too "
                 "high for this stage: lower it or lengthen the warm-up), then alternating "
                 "data (unshuffled sources)",
                 {"autocorrelation": rho, "swing": swing, "usual_swing": ref, "loss": loss}))


class VanishingDetector(Detector):
    """The global gradient norm vanishing; see the module docstring."""

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
                     f"{self.low} steps" + (f" (recent median {ref:.3g})" if ref else "")
                     + ". Check first: the loss (constant? masked out?), then the learning "
                     "rate schedule and the loss scale",
                     {"grad_norm": norm, "recent_median": ref, "steps": self.low})]
        return []


class TensorNormDetector(Detector):
    """Per tensor: a gradient norm that collapses below ``collapse`` of its own recent level
    for ``patience`` steps (``vanishing_grad``), or jumps above ``explode`` times it
    (``exploding_grad``). The level is an exponential average (``alpha``) of the log norm,
    armed after ``warmup`` steps; collapsed and exploded steps stay out of it."""

    def __init__(self, names: list[str], collapse: float = 1e-3, explode: float = 100.0,
                 patience: int = 3, warmup: int = 20, alpha: float = 0.05):
        self.names = names
        self.lo, self.hi = math.log(collapse), math.log(explode)
        self.patience, self.warmup, self.alpha = patience, warmup, alpha
        self.level = torch.full((len(names),), math.nan, dtype=torch.float64)
        self.seen = torch.zeros(len(names), dtype=torch.int64)
        self.low = torch.zeros(len(names), dtype=torch.int64)
        self.reported_low = torch.zeros(len(names), dtype=torch.bool)
        self.reported_high = torch.zeros(len(names), dtype=torch.bool)

    def observe(self, s: HostStep) -> list[Found]:
        if not s.values["grads_finite"] or not s.per_norm:
            return []
        norm = torch.tensor(s.per_norm, dtype=torch.float64)
        present = ~norm.isnan()
        log = norm.clamp(min=0).log()  # 0 -> -inf: a collapse
        armed = present & (self.seen >= self.warmup) & self.level.isfinite()
        low = armed & (log < self.level + self.lo)
        high = armed & (log > self.level + self.hi)
        normal = present & ~low & ~high & log.isfinite()
        first = normal & self.level.isnan()
        self.level = torch.where(first, log, self.level)
        self.level = torch.where(normal & ~first,
                                 (1 - self.alpha) * self.level + self.alpha * log, self.level)
        self.seen += normal.long()
        self.low = torch.where(low, self.low + 1, torch.where(present, 0, self.low))
        found = []
        new_low = (self.low >= self.patience) & ~self.reported_low
        if new_low.any() and not bool((low | ~present).all()):  # all at once: the global rule
            found.append(self._vanishing(new_low, norm))
        self.reported_low = (self.reported_low | new_low) & ~(normal & ~first)
        new_high = high & ~self.reported_high
        if new_high.any():
            found.append(self._exploding(new_high, norm))
        self.reported_high = (self.reported_high | new_high) & ~normal
        return found

    def _vanishing(self, mask: torch.Tensor, norm: torch.Tensor) -> Found:
        return self._event(
            "vanishing_grad", mask, norm,
            f"collapsed to below {math.exp(self.lo):g} of their usual size for "
            f"{self.patience} steps",
            "dead units (a ReLU layer whose pre-activations went negative: its bias, the "
            "learning rate), saturated activations (sigmoid/tanh inputs far from 0), then "
            "parameters frozen by mistake")

    def _exploding(self, mask: torch.Tensor, norm: torch.Tensor) -> Found:
        return self._event(
            "exploding_grad", mask, norm, f"are over {math.exp(self.hi):g}x their usual size",
            "those tensors' weights (growing without bound? check_params), their learning "
            "rate and weight decay, then clipping (max_grad_norm)")

    def _event(self, kind: str, mask: torch.Tensor, norm: torch.Tensor, seen: str,
               check: str) -> Found:
        idx = mask.nonzero().flatten().tolist()
        named = {self.names[i]: {"norm": float(norm[i]), "level": math.exp(self.level[i])}
                 for i in idx}
        return (kind, f"the gradients of {len(named)} tensor(s) {seen}: {_listed(named)}. "
                f"Check first: {check}", {"tensors": named})


class StallDetector(Detector):
    """A run that does not learn from the start (``stall``), judged once, after ``steps``
    finite losses, against the median of the first ``first`` (medians of ``recent`` values,
    so that one lucky batch does not count as learning):

    some tensors' gradients have stayed below ``vanish_ratio`` (1e-5) of the largest tensor's
    for every one of the last ``recent`` steps, while the loss has fallen by less than ``half``
    (50%): the signal does not get through to them (saturated sigmoids, depth without residuals
    or normalisation, a bad initialisation), and what learning there is happens in the layers
    it reaches. A flat loss alone is not enough: healthy SGD runs can sit on their initial
    plateau for well over a hundred steps before they leave it.

    In healthy networks, the smallest gradient norm of a trained tensor stays within a few
    orders of magnitude of the largest; in a 12-layer sigmoid stack the first layers' are
    10 orders below. The message names the tensors whose gradients vanish. After its one
    judgement the rule is done for the run: a plateau later on is not a stall from the start.
    """

    def __init__(self, names: list[str], steps: int = 100, first: int = 10, recent: int = 10,
                 vanish_ratio: float = 1e-5, half: float = 0.5):
        self.names, self.steps, self.half = names, steps, half
        self.first_n, self.vanish_ratio = first, vanish_ratio
        self.losses: deque[float] = deque(maxlen=recent)
        self.vanished: deque[frozenset[int]] = deque(maxlen=recent)  # per step: tensor indices
        self.start: float | None = None
        self.firsts: list[float] = []
        self.best = math.inf
        self.seen = 0
        self.done = False

    def observe(self, s: HostStep) -> list[Found]:
        loss = s.values["loss"]
        if self.done or not math.isfinite(loss):
            return []
        self.seen += 1
        self.losses.append(loss)
        if s.values["grads_finite"] and s.per_norm:
            self.vanished.append(self._vanishing(s.per_norm))
        if self.start is None:
            self.firsts.append(loss)
            if len(self.firsts) == self.first_n:
                self.start = statistics.median(self.firsts)
            return []
        self.best = min(self.best, statistics.median(self.losses))
        if self.seen < self.steps:
            return []
        self.done = True
        fell = (self.start - self.best) / abs(self.start) if self.start else math.inf
        always = frozenset.intersection(*self.vanished) if self.vanished else frozenset()
        if always and fell < self.half:
            return [self._finding(fell, sorted(always))]
        return []

    def _vanishing(self, norms: list[float]) -> frozenset[int]:
        top = max((n for n in norms if n == n), default=0.0)
        return frozenset(i for i, n in enumerate(norms)
                         if n == n and top > 0 and n < self.vanish_ratio * top)

    def _finding(self, fell: float, vanished: list[int]) -> Found:
        names = [self.names[i] for i in vanished]
        where = (f" The gradients of {len(names)} tensor(s) stay below "
                 f"{self.vanish_ratio:g} of the largest: {_listed(names)} (vanishing "
                 "gradients: saturated activations, depth without residuals or "
                 "normalisation, the initialisation)." if names else "")
        return ("stall",
                f"the loss has not learned in {self.seen} steps: its best level "
                f"{self.best:.4g} is {max(fell, 0.0):.1%} below its start {self.start:.4g}."
                f"{where} Check first: whether the gradients reach every layer, then the "
                "learning rate (0? far too small?), then the labels (shuffled apart from the "
                "inputs?)",
                {"best": self.best, "start": self.start, "fell": fell, "steps": self.seen,
                 "vanished": names})


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
                 f"{int(count)} NaN/Inf values in optimizer state: {_listed(names)}"
                 ". Check first: a checkpoint loaded into the optimizer, then a step that "
                 "went through with a non-finite gradient (on_nonfinite='warn'?)",
                 {"tensors": names, "count": int(count)})]


class LossScaleDetector(Detector):
    """A GradScaler's scale below ``min_loss_scale`` or NaN, or down ``drop`` times or more
    within ``within`` steps; reported when it falls."""

    def __init__(self, min_loss_scale: float, drop: float = 8.0, within: int = 10) -> None:
        self.min_loss_scale, self.drop = min_loss_scale, drop
        self.recent: deque[float] = deque(maxlen=within + 1)
        self.collapsed = False

    def observe(self, s: HostStep) -> list[Found]:
        scale = s.values["loss_scale"]
        self.recent.append(scale)
        peak = max((x for x in self.recent if math.isfinite(x)), default=math.nan)
        fell_fast = math.isfinite(scale) and peak >= self.drop * scale
        collapsed = not math.isfinite(scale) or scale < self.min_loss_scale or fell_fast
        fell, self.collapsed = collapsed and not self.collapsed, collapsed
        if not fell:
            return []
        why = (f"below {self.min_loss_scale:g}" if not fell_fast or scale < self.min_loss_scale
               else f"down from {peak:.3g} within {len(self.recent) - 1} steps")
        return [("loss_scale_collapse",
                 f"GradScaler scale fell to {scale:.3g} ({why}): float16 gradients overflow "
                 "step after step. Check first: activations or losses beyond float16's range "
                 "(ActivationMonitor(range_dtype=torch.float16)), then bfloat16 instead",
                 {"scale": scale, "peak": peak, "min_loss_scale": self.min_loss_scale})]


class ReplicaDivergenceDetector(Detector):
    """Replicas (DDP's copies of the gradients) that disagree, under a process group: reported
    once until they agree again, naming the ranks."""

    def __init__(self) -> None:
        self.active = False

    def observe(self, s: HostStep) -> list[Found]:
        count = s.values.get("replica_mismatch", math.nan)
        if not count > 0:
            self.active = False
            return []
        if self.active:
            return []
        self.active = True
        ranks = decode_ranks(s.values["replica_mismatch_mask"])
        return [("replica_divergence",
                 f"the gradients of {int(count)} rank(s) differ from their replicas': ranks "
                 f"{_listed(map(str, ranks))}. Check first: those ranks' hardware (silent data "
                 "corruption: ECC errors, a failing GPU), then whether every rank runs the same "
                 "code and data order (a desynchronised rank)",
                 {"ranks": ranks, "count": int(count)})]


def default_detectors(names: list[str], *, spike_zscore: float, spike_window: int,
                      warmup_steps: int, vanishing_threshold: float,
                      min_loss_scale: float | None) -> list[Detector]:
    """The Monitor's rules in reporting order; the loss-scale rule only with a GradScaler
    (``min_loss_scale`` not None)."""
    scaler = min_loss_scale is not None
    found: list[Detector] = [
        NonFiniteLossDetector(),
        NonFiniteGradDetector(names, scaler=scaler),
        SpikeDetector(spike_zscore, spike_window, warmup_steps),
        DivergenceDetector(warmup=warmup_steps),
        GradNormTrendDetector(warmup=warmup_steps),
        LRJumpDetector(warmup=warmup_steps),
        OscillationDetector(warmup=warmup_steps),
        VanishingDetector(abs_threshold=vanishing_threshold, window=spike_window,
                          warmup=warmup_steps),
        TensorNormDetector(names, warmup=warmup_steps),
        StallDetector(names),
        OptimizerStateDetector(),
        ReplicaDivergenceDetector(),
    ]
    if min_loss_scale is not None:
        found.append(LossScaleDetector(min_loss_scale))
    return found
