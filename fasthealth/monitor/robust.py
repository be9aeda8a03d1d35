"""Robust statistics of a series' recent history, one definition for the host rules and the
device skip rule (docs/spec.md section 6, "Spike scoring").

A value is judged against the *median* of the last ``RECENT`` values, in *noise units*: the
``NOISE_QUANTILE`` quantile of the absolute step-to-step differences over the window (or over
its last ``RECENT`` values, when those are noisier) divided by its value for Gaussian noise,
so that for Gaussian noise the unit is the standard deviation. Minibatch noise is heavy-tailed,
and a window may still hold a long descent: a mean and a standard deviation around it were far
too wide to see a bad batch there and too narrow at a noisy loss floor; differences leave a
steady trend out, and the recent median follows it.

``spike_scores`` (host, Python lists) and ``spike_scores_t`` (device, tensors of fixed shape, no
sync) are the same function; ``tests/monitor/test_act.py`` checks them equal on the same series.
"""

from __future__ import annotations

import functools
import math
import operator
import statistics
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

# The defaults of the thresholds the Monitor's keywords set, defined here once: ``DetectOptions``
# and the Monitor's keywords (where their reasons are written), ``rules.Context``, each rule's
# ``Config`` and the device skip rule read them.
SPIKE_ZSCORE = 6.0
"""Noise units above the recent level: a spike (``rules/spike.py``'s SpikeConfig.zscore)."""
SPIKE_WINDOW = 128
"""Recent values a level and its noise are taken from (``DetectOptions.spike_window``)."""
WARMUP_STEPS = 20
"""Values a window needs before it judges (``DetectOptions.warmup_steps``)."""
VANISHING_THRESHOLD = 1e-8
"""A global gradient norm below it has stopped training (``vanishing_threshold``,
``VanishingConfig.abs_threshold``)."""
MIN_LOSS_SCALE = 1.0
"""A GradScaler scale below it shrinks the loss (``min_loss_scale``,
``LossScaleConfig.min_loss_scale``)."""
SPIKE_MAX_RUN = 5
"""Spikes in a row that make a new level: a level that stays is a change of regime, not a
batch; the host rule takes it into its window and the device rule stops skipping after as
many (``SpikeConfig.max_run``, ``SkipConfig.max_run``)."""

NOISE_QUANTILE = 0.9
"""The differences' quantile that sets the unit: high enough to measure the body of the noise,
below its heavy tail (a spike in the window widens a 0.9 quantile of 128 differences little)."""
NOISE_PER_SIGMA = 1.6449 * math.sqrt(2)
"""The 0.9 quantile of |a - b| for a, b ~ N(0, 1) (1.645 x sqrt 2): the unit is then sigma."""
RECENT = 32
"""Values in the recent level (the median) and the recent noise: a median of 32 follows a
descent within a few steps and ignores up to 15 outliers."""
MIN_LOG_NOISE = 0.005
"""The smallest noise unit on the log scale: at a plateau whose losses differ by 0.1% a step a
1.4% bump scored 7 units; with the floor a spike stands at least 3% above the level (6 units),
and that family (digits under SGD with momentum, on a plateau) raises no alarm (the detector
evaluation)."""

FLOOR_RISE: float = 0.1
"""A loss spike is an alarm only when it rises at least this share of the loss the run
started from (the median of its first values; of its recent level, when that is higher) above
its recent median; a smaller one is a notice. At a floor the noise unit shrinks with the
noise: a converged classifier under label smoothing (floor 0.52, from 2.3) has healthy batches
5-20% above its median scoring 6-9 units, and a memorised small set (floor 1e-6, from 1.05)
batches at 0.004-0.06 scoring hundreds: over 8,000 steps, 15 and 13 alarms a run that nothing
caused, each gone the next step (the long runs). Those rise 1-6% of the start;
the corpus's bad batches at their step 82% and more (garbage 0.82-1.5, mislabelled 1.7-1.9, a
target x50 thousands: the detector corpus, short and long runs). The spike rule's alarms and
the device skip rule's loss paths both need it (``rules/spike.py``, ``skip_rule.py``)."""

TAIL_STEPS: int = 2000
"""Scored losses after which a loss spike is also judged against the run's own tail: a run
this long has shown what its healthy batches reach (``TAIL_RATE``, ``TAIL_MARGIN``)."""

TAIL_RATE: float = 1e-3
"""The run's tail: the score its losses have exceeded once per this many scored steps (the
k-th largest score so far, k = steps x this), the current one left out."""

TAIL_MARGIN: float = 2.0
"""A loss spike scoring less than this many times the run's tail is a notice: the run's own
batches reach that far a few times per thousand steps (heavy-tailed noise, dropout at a
floor), and a fault to catch stands beyond them. On the long runs' tuning part
(the long runs) the only healthy alarms, two outlier batches of a regression
with heavy-tailed noise, scored 1.27x and 1.30x their run's tail; of the faults planted late
that spike the loss, a garbage batch scored 5.1x and the others 17x to millions, but for
weights growing in a family unstable by then (0.7-0.9x: caught by its other rules). The
score is the smaller of the two scales', the one the tail is made of, also for a spike the
spike rule's ``above_max`` path found (a set memorised under dropout: a missed sample 0.1-0.26
from 2e-4 scores 17-31x the tail on the linear scale, 1.3x on the log one); and the spike must
rise less than ``TAIL_RISE``. 0: off."""

TAIL_RISE: float = 0.5
"""A loss spike within the run's tail is a notice only when it rose less than this share of
the loss the run started from above its recent median. Heavy-tailed healthy batches rose 42%
at most (a regression's outlier batches, 4.5x its median) and a sample missed under dropout at
a memorised floor 40% (0.26 from 2e-4, start 0.65); in a run that had grown unstable
(RMSprop at a floor, its own tail 8.8 units), weights starting to explode rose 87% in the
step the rule must catch them at (the long runs' tuning part)."""

TAIL_KEEP: int = 64
"""Largest scores kept (the tail's k is at most this: past 64,000 steps, the 64th largest)."""


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, interpolated linearly (torch.quantile's default)."""
    return _quantile_sorted(sorted(xs), q)


def _quantile_sorted(xs: list[float], q: float) -> float:
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@functools.lru_cache(maxsize=64)
def _centered(n: int) -> tuple[tuple[float, ...], float]:
    """(i - the mean of 0..n-1 for each i, the sum of their squares), made once per n."""
    xm = (n - 1) / 2
    xs = tuple(i - xm for i in range(n))
    return xs, sum(x ** 2 for x in xs)


def slope_t(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` against 0..n-1, and its t-statistic."""
    n = len(ys)
    xs, sxx = _centered(n)
    ym = statistics.fmean(ys)
    slope = sum(map(operator.mul, xs, [y - ym for y in ys])) / sxx
    resid = sum([(y - ym - slope * x) ** 2 for x, y in zip(xs, ys)])
    se = math.sqrt(resid / max(n - 2, 1) / sxx)
    return slope, (slope / se if se > 0 else (math.inf if slope > 0 else 0.0))


def noise_unit(values: list[float]) -> float:
    """The noise unit of the step-to-step differences of ``values`` (0 with fewer than 2);
    a difference with a NaN (a gap) on either side is left out."""
    diffs = [abs(b - a) for a, b in zip(values, values[1:]) if a == a and b == b]
    return quantile(diffs, NOISE_QUANTILE) / NOISE_PER_SIGMA if diffs else 0.0


def level_and_noise(values: list[float], recent: int = RECENT) -> tuple[float, float]:
    """(the median of the last ``recent`` values, the larger of the noise units of the whole
    window and of its last ``recent`` values). The recent noise counts when the run has become
    noisier than its window: a classifier leaving a flat plateau for a fast, noisy descent
    would otherwise have that descent's ordinary swings judged against the plateau's noise."""
    noise = max(noise_unit(values), noise_unit(values[-recent:]))
    level = [v for v in values[-recent:] if v == v]  # NaN: a gap (see spike_scores)
    return (statistics.median(level) if level else math.nan), noise


def _z(values: list[float], x: float, floor: float = 0.0) -> float:
    level, noise = level_and_noise(values)
    noise = max(noise, floor)
    return (x - level) / noise if noise > 0 else (math.inf if x > level else 0.0)


def spike_scores(values: list[float], x: float) -> tuple[float, float]:
    """How far ``x`` stands above the recent level of ``values``, in noise units, on the linear
    and on the log scale (its unit at least ``MIN_LOG_NOISE``). The log scale needs ``x > 0``
    and no negative value; a value of exactly 0 (a loss that underflowed on a batch the model
    fits) is a gap there, not minus infinity, nor a reason to drop the log scale: a fitted
    classifier's losses span orders of magnitude, and on the linear scale alone its ordinary
    hard batch scored 8.8 units (the trainer evaluation, under Lightning). Without a
    positive value among the recent ones the log score is the linear one."""
    lin = _z(values, x)
    if x > 0 and min(values) >= 0:
        log = _z([math.log(v) if v > 0 else math.nan for v in values], math.log(x),
                 MIN_LOG_NOISE)
        if log == log:
            return lin, log
    return lin, lin


class _Scale:
    """One scale (linear or log) of a ``SpikeWindow``: its values in order (NaN: a gap) and,
    kept sorted as values come and go, the non-NaN step-to-step differences of the window, those
    among its last ``tail`` values, and those last values themselves: what ``level_and_noise``
    sorts afresh at every call."""

    def __init__(self, width: int, tail: int) -> None:
        self.width, self.tail = width, tail
        self.vals: deque[float] = deque()
        self.diffs: deque[float] = deque()  # diffs[i]: |vals[i+1] - vals[i]|, NaN at a gap
        self.all_diffs: list[float] = []
        self.tail_diffs: list[float] = []
        self.tail_vals: list[float] = []

    def push(self, y: float) -> None:
        vals, diffs, tail = self.vals, self.diffs, self.tail
        if vals:
            d = abs(y - vals[-1])
            diffs.append(d)
            if d == d:
                insort(self.all_diffs, d)
                insort(self.tail_diffs, d)
        vals.append(y)
        if y == y:
            insort(self.tail_vals, y)
        if len(vals) > tail:  # the value and the difference that left the tail
            _discard(self.tail_vals, vals[-tail - 1])
        if len(diffs) > tail - 1:
            _discard(self.tail_diffs, diffs[-tail])
        if len(vals) > self.width:
            vals.popleft()
            _discard(self.all_diffs, diffs.popleft())

    def z(self, x: float, floor: float) -> float:
        """``_z(list(self.vals), x, floor)``, from the sorted views."""
        noise = 0.0
        if self.all_diffs:
            noise = _quantile_sorted(self.all_diffs, NOISE_QUANTILE) / NOISE_PER_SIGMA
        if self.tail_diffs:
            noise = max(noise, _quantile_sorted(self.tail_diffs, NOISE_QUANTILE)
                        / NOISE_PER_SIGMA)
        level = _median_sorted(self.tail_vals)
        noise = max(noise, floor)
        return (x - level) / noise if noise > 0 else (math.inf if x > level else 0.0)


def _discard(xs: list[float], x: float) -> None:
    if x == x:
        del xs[bisect_left(xs, x)]


def _median_sorted(xs: list[float]) -> float:
    """``statistics.median`` of a sorted list (NaN when empty)."""
    n = len(xs)
    if not n:
        return math.nan
    i = n // 2
    return xs[i] if n % 2 else (xs[i - 1] + xs[i]) / 2


class WindowValues:
    """A state field that is the values of a sorted window (``SpikeWindow``, ``RollingMedian``)
    held in the attribute ``attr``: reading it gives the window's deque (read it only: the
    window keeps its statistics); setting it (a restored state) rebuilds the window from the
    values, at its width."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else getattr(obj, self.attr).values

    def __set__(self, obj: Any, values: Iterable[float]) -> None:
        old = getattr(obj, self.attr)
        setattr(obj, self.attr, type(old)(old.width, values))


class RollingMedian:
    """The last ``width`` finite values (``values``, oldest first) and their median, kept
    sorted as values come and go: ``median()`` is ``statistics.median(values)`` without a
    sort. Change ``values`` only through ``append``."""

    def __init__(self, width: int, values: Iterable[float] = ()) -> None:
        self.width = width
        self.values: deque[float] = deque(maxlen=width)
        self._sorted: list[float] = []
        for v in values:
            self.append(v)

    def __len__(self) -> int:
        return len(self.values)

    def append(self, v: float) -> None:
        if len(self.values) == self.values.maxlen:
            _discard(self._sorted, self.values[0])
        self.values.append(v)
        insort(self._sorted, v)

    def median(self) -> float:
        return _median_sorted(self._sorted)


class SpikeWindow:
    """The last ``width`` values of a series, scored as ``spike_scores`` scores them, with the
    same numbers: the statistics are kept sorted as values come and go (a value in, one out),
    so a score costs a few bisections instead of sorting the window four times. ``values`` is
    the window, oldest first; change it only through ``append`` and ``clear``."""

    def __init__(self, width: int, values: Iterable[float] = ()) -> None:
        self.width = width
        self.values: deque[float] = deque(maxlen=width)
        self.clear()
        for v in values:
            self.append(v)

    def clear(self) -> None:
        self.values.clear()
        tail = min(RECENT, self.width)
        self._lin, self._log = _Scale(self.width, tail), _Scale(self.width, tail)
        self._negative = 0  # values below 0 in the window: then no log scale

    def __len__(self) -> int:
        return len(self.values)

    def append(self, v: float) -> None:
        if len(self.values) == self.width and self.values[0] < 0:
            self._negative -= 1
        self.values.append(v)
        self._negative += v < 0
        self._lin.push(v)
        self._log.push(math.log(v) if v > 0 else math.nan)

    def scores(self, x: float) -> tuple[float, float]:
        """``spike_scores(list(self.values), x)``."""
        lin = self._lin.z(x, 0.0)
        if x > 0 and not self._negative:
            log = self._log.z(math.log(x), MIN_LOG_NOISE)
            if log == log:
                return lin, log
        return lin, lin


def spike_score(values: list[float], x: float) -> float:
    """The smaller of ``spike_scores``: a spike must stand out on both scales."""
    return min(spike_scores(values, x))


_TINY = 1e-300  # keeps log() finite on positive values; non-positive ones turn the log off


def _noise_z_t(win: torch.Tensor, v: torch.Tensor, floor: torch.Tensor,
               qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_z`` per row of ``win`` (oldest first, NaN where empty), ``floor`` per row, and each
    row's level (the median of its last ``RECENT`` values); ``qs`` holds (NOISE_QUANTILE,
    0.5): the three statistics come from one sort."""
    rows = win.shape[0]
    diffs = (win[:, 1:] - win[:, :-1]).abs()
    width = diffs.shape[1]
    recent_diffs = F.pad(diffs[:, -(RECENT - 1):], (0, width - RECENT + 1), value=math.nan)
    recent_values = F.pad(win[:, -RECENT:], (0, width - RECENT), value=math.nan)
    q = torch.nanquantile(torch.cat([diffs, recent_diffs, recent_values]), qs, dim=1)
    # the median as statistics.median takes it (the mean of the middle two of an even count;
    # nanmedian would take the lower one)
    level = q[1, 2 * rows:]
    # a recent stretch without two values (NaN) leaves the whole window's noise
    noise = torch.fmax(q[0, :rows], q[0, rows:2 * rows]) / NOISE_PER_SIGMA
    noise = torch.fmax(noise, floor)
    z = (v - level) / noise
    flat = torch.where(v > level, math.inf, 0.0)  # a window without noise: any rise is out
    return torch.where(noise > 0, z, flat), level


def score_constants(series: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``spike_scores_t`` needs beside the data, made once (a tensor made per step would
    be a host-to-device copy per step, and none can be made inside a CUDA graph capture): the
    noise floor of each row (none on the linear scale, MIN_LOG_NOISE on the log one) and the
    quantiles (NOISE_QUANTILE, the median)."""
    floor = torch.tensor([0.0] * series + [MIN_LOG_NOISE] * series, dtype=torch.float64,
                         device=device)
    return floor, torch.tensor([NOISE_QUANTILE, 0.5], dtype=torch.float64, device=device)


def spike_scores_t(win: torch.Tensor, v: torch.Tensor,
                   constants: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``spike_score`` for each row of ``win`` ((series, window) float64, oldest first, NaN
    where empty) against the value of ``v`` (series,): the smaller of the linear and log
    scores where the log scale applies (as ``spike_scores`` says), else the linear one; and
    each row's recent median (its level on the linear scale). No host sync; the window must
    hold at least ``RECENT`` slots; ``constants`` from ``score_constants``."""
    floor, qs = constants
    # rows: linear, then log scale, where a 0 is a gap (NaN) as in spike_scores
    logs = torch.where(win > 0, win.clamp_min(_TINY).log(), math.nan)
    both = torch.cat([win, logs])
    z, level = _noise_z_t(both, torch.cat([v, v.clamp_min(_TINY).log()]), floor, qs)
    lin, log = z.chunk(2)
    usable = ((win >= 0) | win.isnan()).all(1) & (v > 0) & ~log.isnan()
    return torch.where(usable, torch.minimum(lin, log), lin), level[:win.shape[0]]
